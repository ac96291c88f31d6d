//! Fused classifier CPU kernels: the cross-entropy kernels composed into the executor's
//! buffers (16-bit logits widened to f32 and their gradient rounded once; padded columns
//! through a narrowed copy).

use oxiflow_tensor::{CpuBackend, KernelIo, Result};

use super::{Classifier, ClassifierGrad, Composed};
use crate::host_slices::through_wide;
use crate::kernel_io::io_arrays;

/// [loss, dlogits] of logits and targets.
pub(super) fn forward(op: &Classifier, b: &CpuBackend, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| {
        let ([logits, targets], [loss, dlogits]) = io_arrays("classifier", x, out)?;
        Composed::forward(b, logits, targets, op.classes, [loss, dlogits])
    })
}

/// dlogits scaled by dloss row by row.
pub(super) fn backward(
    _op: &ClassifierGrad,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| {
        let ([dlogits, dloss], [y]) = io_arrays("classifier_backward", x, out)?;
        Composed::backward(b, dlogits, dloss, y)
    })
}
