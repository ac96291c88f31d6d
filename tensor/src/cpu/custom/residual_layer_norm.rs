//! Fused residual LayerNorm CPU kernels: the add and LayerNorm kernels composed into the
//! executor's buffers (16-bit data reaches them widened to f32).

use crate::cpu::CpuBackend;
use crate::op::custom::{ResidualLayerNorm, ResidualLayerNormKernels};
use crate::storage::CpuArray;
use crate::Result;

impl ResidualLayerNormKernels for CpuBackend {
    fn residual_layer_norm(
        &self,
        x: [&CpuArray; 4],
        eps: f64,
        out: [&mut CpuArray; 4],
    ) -> Result<()> {
        ResidualLayerNorm::composed_forward(self, x, eps, out)
    }
    fn residual_layer_norm_backward(
        &self,
        x: [&CpuArray; 5],
        dr: Option<&CpuArray>,
        out: [&mut CpuArray; 3],
    ) -> Result<()> {
        ResidualLayerNorm::composed_backward(self, x, dr, out)
    }
}
