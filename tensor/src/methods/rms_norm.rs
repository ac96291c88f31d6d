//! The `Tensor` methods of the rms norm family (`op/rms_norm.rs`): they build its ops
//! and dispatch them.

use crate::dispatch::dispatch;
use crate::op::{F64Bits, RmsNormOp};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// RMS norm over the last dim with weight `[H]`.
    pub fn rms_norm(&self, weight: &Tensor, eps: f64) -> Result<Tensor> {
        let eps = F64Bits::new(eps);
        dispatch(RmsNormOp::Forward { eps }.into(), &[self, weight])
    }
}
