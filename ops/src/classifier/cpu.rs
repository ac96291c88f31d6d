//! Fused classifier CPU kernels: the cross-entropy kernels composed into the executor's
//! buffers (16-bit logits widened to f32 and their gradient rounded once; padded columns
//! through a narrowed copy).

use oxiflow_tensor::{CpuBackend, KernelIo, Result};

use super::{Classifier, ClassifierGrad, Composed};
use crate::host_slices::{kernel_err, through_wide};

/// [loss, dlogits] of logits and targets.
pub(super) fn forward(op: &Classifier, b: &CpuBackend, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| match (x, out) {
        (&[logits, targets], [loss, dlogits]) => {
            Composed::forward(b, logits, targets, op.classes, [loss, dlogits])
        }
        (x, out) => Err(counts("classifier", x.len(), out.len())),
    })
}

/// dlogits scaled by dloss row by row.
pub(super) fn backward(
    _op: &ClassifierGrad,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| match (x, out) {
        (&[dlogits, dloss], [y]) => Composed::backward(b, dlogits, dloss, y),
        (x, out) => Err(counts("classifier_backward", x.len(), out.len())),
    })
}

fn counts(op: &'static str, inputs: usize, outputs: usize) -> oxiflow_tensor::TensorError {
    kernel_err(
        op,
        format!("expects 2 inputs and its output buffers, got {inputs} and {outputs}"),
    )
}
