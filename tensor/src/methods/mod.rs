//! The `Tensor` API of the op families: one file per family (`op/<family>.rs` defines the ops),
//! each building its family's ops and running them through dispatch. This layer sits above
//! dispatch; the op definitions below it never call dispatch themselves: a backward rule runs
//! ops through these methods, or through [`Tensor::apply`] for an op with attributes no public
//! method takes.

mod attention;
mod cast_copy;
mod custom;
mod dropout;
mod elementwise;
mod embedding;
mod gather;
mod layout;
pub(crate) mod loss;
mod mask;
mod matmul;
mod norm;
mod reduction;
mod rms_norm;
mod rotary;
mod softmax;

use crate::dispatch::dispatch;
use crate::op::Op;
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Runs a single-output `op` on `inputs` through dispatch.
    pub(crate) fn apply(op: impl Into<Op>, inputs: &[&Tensor]) -> Result<Tensor> {
        dispatch(op.into(), inputs)
    }
}
