//! [`CoreKernels`]: the kernel traits of every core family (and the extern ops'), what a
//! backend implements beside the custom ops' ([`super::CustomKernels`], which requires these).

use super::attention::AttentionKernels;
use super::dropout::DropoutKernels;
use super::elementwise::ElementwiseKernels;
use super::embedding::EmbeddingKernels;
use super::extern_op::ExternKernels;
use super::gather::GatherKernels;
use super::layout::LayoutKernels;
use super::loss::LossKernels;
use super::mask::MaskKernels;
use super::matmul::MatmulKernels;
use super::norm::NormKernels;
use super::reduction::ReductionKernels;
use super::rms_norm::RmsNormKernels;
use super::rotary::RotaryKernels;
use super::softmax::SoftmaxKernels;

/// Declares [`CoreKernels`] over the listed kernel traits, implemented for every type that has
/// them all.
macro_rules! core_kernels {
    ($($kernels:ident),* $(,)?) => {
        /// The kernels of every core family on one piece type.
        pub trait CoreKernels: $($kernels +)* {}
        impl<T: $($kernels +)*> CoreKernels for T {}
    };
}

core_kernels! {
    ElementwiseKernels,
    MatmulKernels,
    ReductionKernels,
    SoftmaxKernels,
    LayoutKernels,
    EmbeddingKernels,
    NormKernels,
    LossKernels,
    RmsNormKernels,
    AttentionKernels,
    DropoutKernels,
    GatherKernels,
    MaskKernels,
    RotaryKernels,
    ExternKernels,
}
