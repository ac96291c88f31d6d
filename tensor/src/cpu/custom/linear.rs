//! Fused linear layer CPU kernels: the matmul, add and GELU kernels composed into the
//! executor's buffers (16-bit data reaches them widened to f32).

use oxiflow_dtype::MatmulPrecision;

use crate::cpu::CpuBackend;
use crate::op::custom::{Activation, LinearKernels, LinearOp};
use crate::storage::CpuArray;
use crate::Result;

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
        LinearOp::composed_forward(self, (act, precision), x, w, bias, out)
    }
    fn linear_weight_grad(
        &self,
        precision: MatmulPrecision,
        x: &CpuArray,
        dpre: &CpuArray,
        out: &mut [CpuArray],
    ) -> Result<()> {
        LinearOp::composed_weight_grad(self, precision, x, dpre, out)
    }
}
