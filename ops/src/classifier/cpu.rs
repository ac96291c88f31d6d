//! Fused classifier CPU kernels: the cross-entropy kernels composed into the executor's
//! buffers (16-bit logits widened to f32 and their gradient rounded once; padded columns
//! through a narrowed copy).

use oxiflow_tensor::{CpuBackend, KernelIo, Result};

use super::{Classifier, ClassifierGrad, Composed};
use crate::host_slices::wide_arrays;

/// [loss, dlogits] of logits and targets.
pub(super) fn forward(op: &Classifier, b: &CpuBackend, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    wide_arrays("classifier", io, |[logits, targets], [loss, dlogits]| {
        Composed::forward(b, logits, targets, op.classes, [loss, dlogits])
    })
}

/// dlogits scaled by dloss row by row.
pub(super) fn backward(
    _op: &ClassifierGrad,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    wide_arrays("classifier_backward", io, |[dlogits, dloss], [y]| {
        Composed::backward(b, dlogits, dloss, y)
    })
}
