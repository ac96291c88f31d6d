//! The residual LayerNorm's CUDA kernel: the library's one-pass fused forward
//! (`oxiflow_cuda::residual_layer_norm_forward`), or the add and LayerNorm kernels composed
//! where it does not serve the call.

use oxiflow_cuda::{device_error, residual_layer_norm_forward, CudaKernels};
use oxiflow_tensor::{KernelIo, Result};

use super::{composed, ResidualLayerNorm};

pub(super) fn forward(
    op: &ResidualLayerNorm,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let ([x, a, w, bias], [r, y, mean, rstd]) = (io.inputs, io.outputs) else {
        return Err(device_error(
            "residual_layer_norm",
            "expects 4 inputs and 4 outputs",
        ));
    };
    let (ins, eps) = ([*x, *a, *w, *bias], op.eps.get());
    if residual_layer_norm_forward(b, ins, eps, [&mut *r, &mut *y, &mut *mean, &mut *rstd])? {
        return Ok(());
    }
    composed(b, ins, eps, [r, y, mean, rstd])
}
