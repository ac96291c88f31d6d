//! Fused linear layer CPU kernels: the matmul, add and GELU kernels composed into the
//! executor's buffers (16-bit data reaches them widened to f32).

use crate::cpu::CpuBackend;
use crate::op::custom::{Activation, LinearKernels, LinearOp};
use crate::storage::CpuArray;
use crate::Result;

impl LinearKernels for CpuBackend {
    fn linear(
        &self,
        act: Activation,
        x: &CpuArray,
        w: &CpuArray,
        bias: Option<&CpuArray>,
        out: &mut [CpuArray],
    ) -> Result<()> {
        LinearOp::composed_forward(self, act, x, w, bias, out)
    }
    fn linear_weight_grad(&self, x: &CpuArray, dpre: &CpuArray, out: &mut [CpuArray]) -> Result<()> {
        LinearOp::composed_weight_grad(self, x, dpre, out)
    }
}
