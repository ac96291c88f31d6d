//! `Grad`: what a backward rule sees (detached inputs, the output, its gradient, which inputs
//! need one), with the tensor constructions several families' rules share.

use oxiflow_sbp::{NdSbp, Shape};

use crate::tensor::Tensor;
use crate::{Result, TensorError};

/// The backward context of one recorded op.
pub(crate) struct Grad<'a> {
    /// The op's inputs, detached.
    pub x: &'a [Tensor],
    /// The op's output.
    pub out: &'a Tensor,
    /// The gradient of the output.
    pub dy: &'a Tensor,
    needs: &'a [bool],
}

impl<'a> Grad<'a> {
    pub fn new(x: &'a [Tensor], out: &'a Tensor, dy: &'a Tensor, needs: &'a [bool]) -> Self {
        Grad { x, out, dy, needs }
    }
    /// Whether input `i` needs a gradient.
    pub fn need(&self, i: usize) -> bool {
        self.needs.get(i).copied().unwrap_or(false)
    }
    /// `f()` when input `i` needs a gradient.
    pub fn when(&self, i: usize, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
        if self.need(i) {
            f().map(Some)
        } else {
            Ok(None)
        }
    }
    /// The gradient of the only input.
    pub fn one(g: Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g)])
    }
    /// The error of an op whose gradient is not defined.
    pub fn unsupported(name: &str, why: &str) -> TensorError {
        TensorError::Autograd {
            op: "backward",
            detail: format!("{name} is not differentiable: {why}"),
        }
    }
}

/// Zeros of `shape` with `like`'s dtype, on `like`'s placement (all-B) or local.
pub(crate) fn zeros_on(like: &Tensor, shape: Shape) -> Result<Tensor> {
    match (like.placement(), like.context()) {
        (Some(p), Some(ctx)) => {
            let _g = ctx.install();
            Tensor::zeros_global(shape, like.dtype(), p, NdSbp::broadcast(p.ndim()))
        }
        _ => Tensor::try_zeros(shape, like.dtype()),
    }
}

/// Zeros in `like`'s own layout (same shape, dtype, placement, nd-SBP).
pub(crate) fn zeros_like(like: &Tensor) -> Result<Tensor> {
    match (like.placement(), like.context(), like.nd_sbp()) {
        (Some(p), Some(ctx), Some(s)) => {
            let _g = ctx.install();
            Tensor::zeros_global(like.shape().clone(), like.dtype(), p, s.clone())
        }
        _ => Tensor::try_zeros(like.shape().clone(), like.dtype()),
    }
}

/// `x`'s shape with `dims` kept as size 1.
pub(crate) fn keepdim_shape(x: &Shape, dims: &[usize]) -> Shape {
    Shape::new(
        x.dims()
            .iter()
            .enumerate()
            .map(|(i, &d)| if dims.contains(&i) { 1 } else { d }),
    )
}

/// The gradient of a broadcast operand: `g` summed down to `like`'s shape.
pub(crate) fn sum_to(g: Tensor, like: &Tensor) -> Result<Tensor> {
    g.sum_to_shape(like.shape().clone())
}
