//! CPU kernels of the custom ops (`op/custom/`): one file per op, implementing its kernel trait
//! for `CpuBackend`.

mod fused_elementwise;
