//! Fused MLP CPU kernels: the linear layer's kernels, an add, the GELU backward and the weight
//! gradients composed into the executor's buffers (the trait's composed kernels; the op's
//! kernel table widens 16-bit data to f32 and rounds each output once).

use oxiflow_tensor::CpuBackend;

use super::ResidualMlpKernels;

impl ResidualMlpKernels for CpuBackend {}
