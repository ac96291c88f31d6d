//! CPU kernels of the custom ops (`op/custom/`): one file per op, implementing its kernel trait
//! for `CpuBackend`.

mod classifier;
mod fused_elementwise;
mod linear;
mod linear_classifier;
mod residual_mlp;
