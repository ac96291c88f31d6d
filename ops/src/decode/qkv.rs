//! `RotaryQkvAt`: the output of a fused query/key/value projection, `[B, T, G, R + 2, D]` (per
//! key/value group: its R query heads, then its key, then its value; the layout whose groups a
//! tensor-parallel split keeps whole), as q `[B, T, G R, D]` and k, v `[B, T, G, D]`, q and k
//! rotated for positions `pos..pos + T` as [`super::rotary_at`] rotates them (`pos` a device
//! value): one pass in place of two rotations and the copies that would split the projection.

use std::sync::LazyLock;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch_multi, Extern, ExternOp, Inferred, Kernels, MetaError, MetaResult, Result, Tensor,
    TensorError,
};

use super::op_types::RotaryQkvAt;
use super::rotary::{float_rotated, frequencies_and_position};
use super::{cpu, cuda, DTYPES};
use crate::op_signature::{kernels_without_gradient, op_signature};
use crate::operand_dtypes::kernels_for;

/// qkv `[B, T, G, R + 2, D]` split into (q `[B, T, G R, D]`, k, v `[B, T, G, D]`), q and k
/// rotated for positions `pos..pos + T` by the frequencies `inv_freq` (f64 `[D / 2]`); `pos`
/// is one i64 on the device (see the module docs).
pub fn rotary_qkv_at(
    qkv: &Tensor,
    inv_freq: &Tensor,
    pos: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let out = dispatch_multi(Extern::new(RotaryQkvAt).into(), &[qkv, inv_freq, pos])?;
    match <[Tensor; 3]>::try_from(out) {
        Ok([q, k, v]) => Ok((q, k, v)),
        Err(v) => Err(TensorError::Kernel {
            op: "rotary_qkv_at",
            detail: format!("gave {} outputs, not 3", v.len()),
        }),
    }
}

static KERNELS: LazyLock<Kernels> =
    LazyLock::new(|| kernels_for::<RotaryQkvAt>(DTYPES, cpu::rotary_qkv_at, cuda::rotary_qkv_at));

impl ExternOp for RotaryQkvAt {
    op_signature!("rotary_qkv_at", 3);
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let qkv = shapes[0];
        float_rotated("qkv", dtypes[0])?;
        let r = rules::rotary_qkv_at(qkv, mode).map_err(MetaError::Shape)?;
        let d = qkv.dims()[4];
        if !d.is_multiple_of(2) {
            return Err(MetaError::Shape(format!(
                "qkv {qkv} must have an even head width"
            )));
        }
        frequencies_and_position("qkv", d, shapes, dtypes)?;
        Ok(Inferred::outputs(r, &[dtypes[0]; 3]))
    }
    kernels_without_gradient!(KERNELS, "decoding runs without gradients");
}
