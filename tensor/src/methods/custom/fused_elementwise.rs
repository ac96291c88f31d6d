//! The `Tensor` methods of the custom op `op/custom/fused_elementwise.rs`: they build its
//! ops and dispatch them.

use std::sync::Arc;

use crate::dispatch::dispatch_multi;
use crate::op::custom::{FusedElementwise, FusedProgram};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Runs fused program `program` on local tensors `inputs` (one per program input, of the
    /// dtypes it reads, shapes that broadcast together) as one kernel: the values of its output
    /// steps (the last step first) as the ops it stands for compute them.
    pub fn fused_elementwise(
        program: &Arc<FusedProgram>,
        inputs: &[&Tensor],
    ) -> Result<Vec<Tensor>> {
        let _ng = crate::grad_mode::no_grad();
        let op = FusedElementwise {
            program: program.clone(),
        };
        dispatch_multi(op.into(), inputs)
    }
}
