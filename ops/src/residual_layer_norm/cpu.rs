//! The residual LayerNorm's CPU kernel: the add and LayerNorm kernels composed into the
//! executor's buffers (16-bit data through f32, rounded once).

use oxiflow_tensor::backend::kernel_err;
use oxiflow_tensor::{CpuBackend, KernelIo, Result};

use super::{composed, ResidualLayerNorm};
use crate::host_slices::through_wide;

pub(super) fn forward(
    op: &ResidualLayerNorm,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| {
        let ([x, a, w, bias], [r, y, mean, rstd]) = (x, out) else {
            return Err(kernel_err(
                "residual_layer_norm",
                "expects 4 inputs and 4 outputs".into(),
            ));
        };
        composed(b, [*x, *a, *w, *bias], op.eps.get(), [r, y, mean, rstd])
    })
}
