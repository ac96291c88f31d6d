//! CUDA kernels of the custom ops (`op/custom/`): one file per op, implementing its kernel trait
//! for `CudaKernels`.

mod classifier;
mod fused_elementwise;
mod linear;
mod linear_classifier;
mod residual_mlp;
