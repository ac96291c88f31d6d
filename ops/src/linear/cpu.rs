//! Fused linear layer CPU kernels: the matmul, add and GELU kernels composed into the
//! executor's buffers (the trait's composed kernels; the op's kernel table widens 16-bit
//! data to f32 and rounds each output once).

use oxiflow_tensor::CpuBackend;

use super::LinearKernels;

impl LinearKernels for CpuBackend {}
