//! Fused linear cross-entropy CPU kernels: the product, classifier, product and sum kernels
//! composed over all rows into the executor's buffers (16-bit data widened to f32, the
//! gradients rounded once); the backward a broadcasting product.

use oxiflow_tensor::{CpuBackend, KernelIo, Result};

use super::{Composed, LinearClassifier, LinearClassifierGrad};
use crate::classifier::Composed as ComposedClassifier;
use crate::host_slices::{kernel_err, through_wide};

/// [loss, dx, dw] of x, the table and targets.
pub(super) fn forward(
    op: &LinearClassifier,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let attrs = (op.classes, op.precision);
    through_wide(io.inputs, io.outputs, |x, out| match (x, out) {
        (&[x, w, targets], [loss, dx, dw]) => Composed::forward(
            b,
            x,
            w,
            targets,
            attrs,
            [loss, dx, dw],
            ComposedClassifier::forward,
        ),
        (x, out) => Err(counts("linear_classifier", x.len(), out.len())),
    })
}

/// dx and dw times dloss.
pub(super) fn backward(
    _op: &LinearClassifierGrad,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| match (x, out) {
        (&[dx, dw, dloss], [ox, ow]) => Composed::backward(b, [dx, dw], dloss, [ox, ow]),
        (x, out) => Err(counts("linear_classifier_backward", x.len(), out.len())),
    })
}

fn counts(op: &'static str, inputs: usize, outputs: usize) -> oxiflow_tensor::TensorError {
    kernel_err(
        op,
        format!("expects 3 inputs and its output buffers, got {inputs} and {outputs}"),
    )
}
