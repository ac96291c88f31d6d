//! SwiGLU, the gated activation of Llama-family MLPs: `y = silu(gate) * up` (`silu(g) = g *
//! sigmoid(g)`), one fused kernel forward and one backward (`dgate = dy * up * silu'(gate)`,
//! `dup = dy * silu(gate)`), on same-shape float operands; and [`swiglu_pairs`], the forward
//! of one packed `[.., F, 2]` input (a fused gate/up product's), for decoding.
//!
//! Layouts (`oxiflow_sbp::rules::pointwise`): split alike on any dim, broadcast, or `up`
//! partial with `gate` broadcast (the output is linear in `up`); the backward likewise, partial
//! through `dy`. Kernels: CPU in f32, f64 and bf16 (computed in f32, rounded once), CUDA in
//! f32, f64, bf16 and f16 (`swiglu.cu`, the library's NVRTC path); any other backend or dtype
//! is `TensorError::NoKernel` on every rank before anything runs.

mod cpu;
pub(crate) mod cuda;
mod pairs;

pub use pairs::swiglu_pairs;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, Extern, ExternOp, Grad, Inferred, MetaError, MetaResult, Result, Tensor,
};

use crate::dispatch_outputs::dispatch_pair;
use crate::op_signature::{kernels_saving_inputs, kernels_without_gradient, op_signature};
use crate::operand_dtypes::{forward_backward_kernels, one_float_dtype};

/// `silu(gate) * up` (inputs: gate, up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwiGlu;

/// SwiGLU of a packed `[.., F, 2]` input (inputs: x; see [`swiglu_pairs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwiGluPairs;

/// The gradients of [`SwiGlu`] (inputs: gate, up, dy; outputs: dgate, dup).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwiGluGrad;

/// `silu(gate) * up` as one op (same shape and float dtype; local or global alike).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    dispatch(Extern::new(SwiGlu).into(), &[gate, up])
}

/// The gradients of `swiglu(gate, up)` given the output's gradient `dy`: (dgate, dup).
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    dispatch_pair(SwiGluGrad, &[gate, up, dy])
}

forward_backward_kernels!(float_kernels());

impl ExternOp for SwiGlu {
    op_signature!("swiglu", 2);
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = one_float_dtype(dtypes)?;
        let r = rules::pointwise(shapes, 1, &[1], mode).map_err(MetaError::Shape)?;
        Ok(Inferred::new(r, dt))
    }
    kernels_saving_inputs!(FORWARD, [0, 1]);
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (dgate, dup) = swiglu_backward(g.input(0)?, g.input(1)?, g.dy()?)?;
        Ok(vec![g.need(0).then_some(dgate), g.need(1).then_some(dup)])
    }
}

impl ExternOp for SwiGluGrad {
    op_signature!("swiglu_backward", 3);
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = one_float_dtype(dtypes)?;
        let r = rules::pointwise(shapes, 2, &[2], mode).map_err(MetaError::Shape)?;
        Ok(Inferred::outputs(r, &[dt, dt]))
    }
    kernels_without_gradient!(BACKWARD, "the gradients of SwiGLU have no gradient here");
}
