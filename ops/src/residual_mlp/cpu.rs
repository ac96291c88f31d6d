//! Fused MLP CPU kernels: the linear layer's kernels, an add, the GELU backward and the weight
//! gradients composed into the executor's buffers (16-bit data widened to f32, each output
//! rounded once).

use oxiflow_dtype::MatmulPrecision;
use oxiflow_tensor::{CpuArray, CpuBackend, KernelIo, Result};

use super::{
    run_backward, run_forward, Composed, ResidualMlp, ResidualMlpGrad, ResidualMlpKernels,
};
use crate::host_slices::wide_kernel;

impl ResidualMlpKernels for CpuBackend {
    fn residual_mlp(
        &self,
        x: [&CpuArray; 6],
        precision: MatmulPrecision,
        out: &mut [CpuArray],
    ) -> Result<()> {
        Composed::forward(self, x, precision, out)
    }
    fn residual_mlp_backward(
        &self,
        x: [&CpuArray; 6],
        precision: MatmulPrecision,
        out: &mut [CpuArray],
    ) -> Result<()> {
        Composed::backward(self, x, precision, out)
    }
}

/// The forward, 16-bit data through f32.
pub(super) fn forward(
    op: &ResidualMlp,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    wide_kernel(op, b, io, run_forward)
}

/// The backward, 16-bit data through f32.
pub(super) fn backward(
    op: &ResidualMlpGrad,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    wide_kernel(op, b, io, run_backward)
}
