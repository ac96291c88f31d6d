//! `RotaryAt`: the rotary embedding of x `[B, T, H, D]` for positions `pos..pos + T`, `pos` a
//! device value: pairs (i, i + D/2) rotate by `position * inv_freq[i]` (GPT-NeoX layout, the
//! frequencies an f64 input `[D / 2]`, so scaled ones serve too); angles in f64, 16-bit inputs
//! rotated in f32 and rounded once.

use std::sync::LazyLock;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, Extern, ExternOp, Inferred, Kernels, MetaError, MetaResult, Result, Tensor,
};

use super::op_types::RotaryAt;
use super::{check_position, cpu, cuda, DTYPES};
use crate::op_signature::{kernels_without_gradient, op_signature};
use crate::operand_dtypes::kernels_for;

/// x `[B, T, H, D]` rotated for positions `pos..pos + T` by the frequencies `inv_freq` (f64
/// `[D / 2]`); `pos` is one i64 on the device (see the module docs).
pub fn rotary_at(x: &Tensor, inv_freq: &Tensor, pos: &Tensor) -> Result<Tensor> {
    dispatch(Extern::new(RotaryAt).into(), &[x, inv_freq, pos])
}

static KERNELS: LazyLock<Kernels> =
    LazyLock::new(|| kernels_for::<RotaryAt>(DTYPES, cpu::rotary_at, cuda::rotary_at));

impl ExternOp for RotaryAt {
    op_signature!("rotary_at", 3);
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let x = shapes[0];
        float_rotated("x", dtypes[0])?;
        let d = match x.dims() {
            &[_, _, _, d] if d % 2 == 0 => d,
            _ => {
                return Err(MetaError::Shape(format!(
                    "x must be [B, T, H, D] with an even D, got {x}"
                )))
            }
        };
        frequencies_and_position("x", d, shapes, dtypes)?;
        Ok(Inferred::new(rules::rotary_at(x, mode), dtypes[0]))
    }
    kernels_without_gradient!(KERNELS, "decoding runs without gradients");
}

/// Checks that the operand a rotation reads (`what`) has a float dtype.
pub(super) fn float_rotated(what: &str, dtype: DType) -> MetaResult<()> {
    if !dtype.is_float() {
        return Err(MetaError::DType(format!(
            "{what} must be a float dtype, got {dtype}"
        )));
    }
    Ok(())
}

/// Checks a rotation's frequencies (input 1: f64 `[d / 2]` for the operand `what` of head
/// width `d`, input 0) and position (input 2).
pub(super) fn frequencies_and_position(
    what: &str,
    d: usize,
    shapes: &[&Shape],
    dtypes: &[DType],
) -> MetaResult<()> {
    let (x, freq) = (shapes[0], shapes[1]);
    if dtypes[1] != DType::F64 || freq.dims() != [d / 2] {
        return Err(MetaError::Shape(format!(
            "the frequencies must be f64 [{}] for {what} {x}, got {} {freq}",
            d / 2,
            dtypes[1]
        )));
    }
    check_position(shapes[2], dtypes[2])
}
