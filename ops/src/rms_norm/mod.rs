//! RMS normalisation over the last dim, fused: `y = x * r * w` with `r = (mean(x^2) + eps)^-1/2`
//! per row, one kernel forward and one backward. 16-bit inputs compute in f32 and round once;
//! f64 computes in f64. The backward recomputes `r` from `x` (nothing but the inputs is saved)
//! and gives `dx = r (dy w - xhat mean(dy w xhat))` (`xhat = x r`) beside the per-element terms
//! `dy xhat` in the wide dtype (f32, or f64 for f64), whose sum over the rows (a dispatched
//! reduction: partial over a split row dim) is the weight's gradient.
//!
//! Layouts (`oxiflow_sbp::rules::rms_norm`, `rms_norm_backward`): rows split on any leading dim
//! with the weight broadcast, or all broadcast; the backward also takes a partial `dy`. Kernels:
//! CPU in f32, f64 and bf16, CUDA in f32, f64, bf16 and f16 (`rms_norm.cu`, one block per row);
//! any other backend or dtype is `TensorError::NoKernel` on every rank before anything runs.

mod cpu;
mod cuda;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, Extern, ExternOp, Grad, Inferred, MetaError, MetaResult, Result, Tensor,
};

use crate::dispatch_outputs::dispatch_pair;
use crate::op_signature::{kernels_saving_inputs, kernels_without_gradient, op_signature};
use crate::operand_dtypes::{forward_backward_kernels, one_float_dtype};

/// `x * (mean(x^2) + eps)^-1/2 * w` over the last dim (inputs: x `[.., H]`, w `[H]`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNorm {
    pub eps: f64,
}

/// The gradients of [`RmsNorm`] (inputs: x, w, dy; outputs: dx, and `dy * xhat` in the wide
/// dtype).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormGrad {
    pub eps: f64,
}

/// x `[.., H]` RMS-normalised over its last dim and scaled by `weight` `[H]` (same float
/// dtype; local or global alike).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    dispatch(Extern::new(RmsNorm { eps }).into(), &[x, weight])
}

/// The gradients of `rms_norm(x, weight, eps)` given the output's gradient `dy`: `dx` (x's
/// dtype) and the weight-gradient terms `dy * xhat` (x's shape, f32 or f64), whose sum over
/// every leading dim is `dweight`.
pub fn rms_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    dispatch_pair(RmsNormGrad { eps }, &[x, weight, dy])
}

forward_backward_kernels!(float_kernels());

/// The dtype the kernels compute (and write the weight-gradient terms) in.
pub fn wide(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// A finite, non-negative epsilon, or why not.
fn checked_eps(eps: f64) -> MetaResult<()> {
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(MetaError::Shape(format!(
            "eps must be finite and non-negative, got {eps}"
        )))
    }
}

impl ExternOp for RmsNorm {
    op_signature!("rms_norm", 2);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&self.eps.to_bits().to_le_bytes());
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        checked_eps(self.eps)?;
        let dt = one_float_dtype(dtypes)?;
        let r = rules::rms_norm(shapes[0], shapes[1], mode).map_err(MetaError::Shape)?;
        Ok(Inferred::new(r, dt))
    }
    kernels_saving_inputs!(FORWARD, [0, 1]);
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (x, w) = (g.input(0)?, g.input(1)?);
        let (dx, terms) = rms_norm_backward(x, w, g.dy()?, self.eps)?;
        let dw = g.when(1, || terms.sum_to_shape(w.shape().clone())?.cast(w.dtype()))?;
        Ok(vec![g.need(0).then_some(dx), dw])
    }
}

impl ExternOp for RmsNormGrad {
    op_signature!("rms_norm_backward", 3);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&self.eps.to_bits().to_le_bytes());
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        checked_eps(self.eps)?;
        let dt = one_float_dtype(dtypes)?;
        let r = rules::rms_norm_backward(shapes, mode).map_err(MetaError::Shape)?;
        Ok(Inferred::outputs(r, &[dt, wide(dt)]))
    }
    kernels_without_gradient!(
        BACKWARD,
        "the gradients of RMS normalisation have no gradient here"
    );
}
