//! CUDA kernels of the custom ops (`op/custom/`): one file per op, implementing its kernel trait
//! for `CudaKernels`.

mod adamw;
mod flash_attention;
mod adamw_multi;
mod classifier;
mod linear;
mod residual_layer_norm;
