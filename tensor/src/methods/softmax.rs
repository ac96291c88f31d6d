//! The `Tensor` methods of the softmax family (`op/softmax.rs`): they build its ops
//! and dispatch them.

use oxiflow_dtype::MatmulPrecision;

use crate::dispatch::dispatch;
use crate::op::{norm_dim, SoftmaxOp};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let dim = norm_dim("softmax", self, dim)?;
        dispatch(SoftmaxOp::Forward { dim, log: false }.into(), &[self])
    }
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let dim = norm_dim("log_softmax", self, dim)?;
        dispatch(SoftmaxOp::Forward { dim, log: true }.into(), &[self])
    }
    /// dx of y = softmax(x, dim) from y and dy.
    pub fn softmax_backward(y: &Tensor, dy: &Tensor, dim: isize) -> Result<Tensor> {
        Tensor::softmax_backward_feeding(y, dy, dim, MatmulPrecision::F32)
    }
    /// [`Tensor::softmax_backward`] of a dx that feeds products at `feeds` (attention's dS).
    pub fn softmax_backward_feeding(
        y: &Tensor,
        dy: &Tensor,
        dim: isize,
        feeds: MatmulPrecision,
    ) -> Result<Tensor> {
        let dim = norm_dim("softmax_backward", y, dim)?;
        let op = SoftmaxOp::Backward {
            dim,
            log: false,
            feeds,
        };
        dispatch(op.into(), &[y, dy])
    }
    /// dx of y = log_softmax(x, dim) from y and dy.
    pub fn log_softmax_backward(y: &Tensor, dy: &Tensor, dim: isize) -> Result<Tensor> {
        let dim = norm_dim("log_softmax_backward", y, dim)?;
        let op = SoftmaxOp::Backward {
            dim,
            log: true,
            feeds: MatmulPrecision::F32,
        };
        dispatch(op.into(), &[y, dy])
    }
}
