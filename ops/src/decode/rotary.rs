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
use crate::op_signature::op_signature;
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
        let (x, freq) = (shapes[0], shapes[1]);
        if !dtypes[0].is_float() {
            return Err(MetaError::DType(format!(
                "x must be a float dtype, got {}",
                dtypes[0]
            )));
        }
        let d = match x.dims() {
            &[_, _, _, d] if d % 2 == 0 => d,
            _ => {
                return Err(MetaError::Shape(format!(
                    "x must be [B, T, H, D] with an even D, got {x}"
                )))
            }
        };
        if dtypes[1] != DType::F64 || freq.dims() != [d / 2] {
            return Err(MetaError::Shape(format!(
                "the frequencies must be f64 [{}] for x {x}, got {} {freq}",
                d / 2,
                dtypes[1]
            )));
        }
        check_position(shapes[2], dtypes[2])?;
        Ok(Inferred::new(rules::rotary_at(x, mode), dtypes[0]))
    }
    fn kernels(&self) -> &Kernels {
        &KERNELS
    }
    fn no_gradient(&self) -> Option<&'static str> {
        Some("decoding runs without gradients")
    }
}
