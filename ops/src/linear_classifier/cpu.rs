//! Fused linear cross-entropy CPU kernels: the product, classifier, product and sum kernels
//! composed over all rows into the executor's buffers (16-bit data widened to f32, the
//! gradients rounded once); the backward a broadcasting product.

use oxiflow_tensor::{CpuBackend, KernelIo, Result};

use super::{Composed, LinearClassifier, LinearClassifierGrad};
use crate::classifier::Composed as ComposedClassifier;
use crate::host_slices::wide_arrays;

/// [loss, dx, dw] of x, the table and targets.
pub(super) fn forward(
    op: &LinearClassifier,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let attrs = (op.classes, op.precision);
    wide_arrays(
        "linear_classifier",
        io,
        |[x, w, targets], [loss, dx, dw]| {
            let classify = ComposedClassifier::forward;
            Composed::forward(b, x, w, targets, attrs, [loss, dx, dw], classify)
        },
    )
}

/// dx and dw times dloss.
pub(super) fn backward(
    _op: &LinearClassifierGrad,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    wide_arrays(
        "linear_classifier_backward",
        io,
        |[dx, dw, dloss], [ox, ow]| Composed::backward(b, [dx, dw], dloss, [ox, ow]),
    )
}
