//! CUDA kernels of the custom ops (`op/custom/`): one file per op, implementing its kernel trait
//! for `CudaKernels`.

mod fused_elementwise;
