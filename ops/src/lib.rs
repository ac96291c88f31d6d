//! Fused ops built outside the tensor core, each through the public op contract only
//! (`oxiflow_tensor::ExternOp`): attributes, shapes and dtypes, SBP candidates from
//! `oxiflow_sbp::rules`, saved tensors and a backward written with dispatched ops, and a kernel
//! table per backend (CPU kernels on host arrays, CUDA kernels compiled through the library's
//! NVRTC path with `oxiflow_cuda::CudaSource`). One folder per op; adding one is its
//! folder and one `pub mod` line below.

pub mod adamw;
pub mod argmax;
pub mod attention;
pub mod classifier;
mod composing_backend;
pub mod context_parallel;
mod cpu_dispatch;
pub mod decode;
mod dispatch_outputs;
mod host_slices;
mod kernel_io;
pub mod linear;
pub mod linear_classifier;
pub mod moe;
mod op_signature;
mod operand_dtypes;
mod operand_shapes;
pub mod residual_layer_norm;
pub mod residual_mlp;
pub mod rms_norm;
pub mod rotary;
pub mod sum_squares;
pub mod swiglu;
