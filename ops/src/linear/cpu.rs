//! Fused linear layer CPU kernels: the matmul, add and GELU kernels composed into the
//! executor's buffers (16-bit data widened to f32, each output rounded once).

use oxiflow_dtype::MatmulPrecision;
use oxiflow_tensor::{CpuArray, CpuBackend, KernelIo, Result};

use super::{
    run_forward, run_weight_grad, Activation, Composed, Linear, LinearKernels, LinearWeightGrad,
};
use crate::host_slices::wide_kernel;

impl LinearKernels for CpuBackend {
    fn linear(
        &self,
        act: Activation,
        precision: MatmulPrecision,
        x: &CpuArray,
        w: &CpuArray,
        bias: Option<&CpuArray>,
        out: &mut [CpuArray],
    ) -> Result<()> {
        Composed::forward(self, (act, precision), x, w, bias, out)
    }
    fn linear_weight_grad(
        &self,
        precision: MatmulPrecision,
        x: &CpuArray,
        dpre: &CpuArray,
        out: &mut [CpuArray],
    ) -> Result<()> {
        Composed::weight_grad(self, precision, x, dpre, out)
    }
}

/// The forward, 16-bit data through f32.
pub(super) fn forward(op: &Linear, b: &CpuBackend, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    wide_kernel(op, b, io, run_forward)
}

/// The weight gradients, 16-bit data through f32.
pub(super) fn weight_grad(
    op: &LinearWeightGrad,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    wide_kernel(op, b, io, run_weight_grad)
}
