//! Fused MLP CPU kernels: the linear layer's kernels, an add, the GELU backward and the weight
//! gradients composed into the executor's buffers.

use oxiflow_dtype::MatmulPrecision;

use crate::cpu::CpuBackend;
use crate::op::custom::{ResidualMlp, ResidualMlpKernels};
use crate::storage::CpuArray;
use crate::Result;

impl ResidualMlpKernels for CpuBackend {
    fn residual_mlp(
        &self,
        x: [&CpuArray; 6],
        precision: MatmulPrecision,
        out: &mut [CpuArray],
    ) -> Result<()> {
        ResidualMlp::composed_forward(self, x, precision, out)
    }
    fn residual_mlp_backward(
        &self,
        x: [&CpuArray; 6],
        precision: MatmulPrecision,
        out: &mut [CpuArray],
    ) -> Result<()> {
        ResidualMlp::composed_backward(self, x, precision, out)
    }
}
