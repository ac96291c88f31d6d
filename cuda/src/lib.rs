//! The CUDA backend of OxiFlow, plugged into the tensor core through its seams (the device
//! backend and op executor registries, the NCCL-world join, `oxiflow_tensor::backend`): a
//! per-device runtime (context, compute stream, caching allocator, cuBLAS handle, NVRTC kernels
//! made ready once per process: embedded at build time when the build was asked for them, else
//! cached or compiled), `CudaStorage` behind the device seam, the `CudaBackend` that runs every
//! dispatched op on device pieces, `CudaPiece`, the boxing executor's local piece on CUDA
//! memory, and the process start-up that binds an NCCL world to the backend (`init_from_env`).
//!
//! One device per process: the runtime is bound once (`init_cuda`, or `init_cuda_on` with the
//! NCCL communicator's context) and every `Device::Cuda(_)` request of this process maps to
//! it. CUDA libraries are found through `collectives::cuda_libs` before cudarc touches them,
//! so a missing library is a typed error, never a panic. Kernels launch on the runtime's
//! compute stream; an `NcclComm` given that stream (`set_compute_stream`) orders its
//! collectives after them, and blocks touched by a collective carry its end event, which the
//! compute stream waits for before it next uses them (see `alloc`): no host synchronisation,
//! and a kernel that does not use a collective's buffers overlaps it.

mod alloc;
pub(crate) mod attention;
mod backend;
pub(crate) mod blaslt;
mod block;
mod boxing;
mod build_times;
mod copy;
mod copy_many;
mod create;
mod cuda_source;
pub(crate) mod cudnn_attention;
mod driver_pool;
mod embedded_kernels;
mod error;
pub(crate) mod flash_attention;
pub(crate) mod fused;
pub(crate) mod fused_elementwise;
pub(crate) mod graph;
mod init;
mod kernel_cache;
mod kernels;
mod library_sources;
mod nvrtc_compile;
mod nvrtc_module;
#[cfg(test)]
mod nvrtc_open;
mod ops;
mod piece;
mod precision;
pub(crate) mod raw;
mod runtime;
mod storage;
mod timing;
mod world;

pub use attention::fused_attention_report;
pub use backend::CudaBackend;
pub use build_times::{kernel_builds, KernelBuild, KernelOrigin};
pub use create::philox_words_device;
pub use cuda_source::{CudaSource, KernelIds};
pub use embedded_kernels::embedded_kernel_archs;
pub use error::{device_error, launched};
pub use fused_elementwise::{prebuild_fused_elementwise, FusedCall};
pub use init::{finish_background_builds, init_cuda, init_cuda_on};
pub use ops::{residual_layer_norm_forward, CudaKernels};
pub use oxiflow_dtype::MatmulPrecision;
pub use piece::CudaPiece;
pub use runtime::{bound_runtime, cuda_unavailable, CudaRuntime, DRIVER_REUSE_FROM};
pub use storage::CudaStorage;
pub use timing::{op_timings, reset_op_timings, set_op_timing};
pub use world::{init_from_env, init_with_env};

pub use alloc::AllocCounts;
pub use block::Block;
pub(crate) use error::derr;
pub(crate) use runtime::runtime;

/// The raw kernel layer under the op kernels, on device pointers: fused attention (cuDNN and
/// the NVRTC flash kernels), cuBLASLt products with epilogues, fused LayerNorm, multi-tensor
/// AdamW, the classifier, vectorised element-wise kernels, the launch of a library kernel
/// ([`launch!`]) and the runtime's blocks with their host copies. The device check
/// (`gpu_kernels_check`) drives these against f64 references.
pub mod kernel_layer {
    pub use crate::attention::{
        attention_backward, attention_forward, prepare_attention_backward, AttentionPath,
    };
    pub use crate::blaslt::{lt_matmul, Epilogue, LtMatmul};
    pub use crate::block::Block;
    pub use crate::copy::{cast, copy_nd, fill};
    pub use crate::fused::{
        adamw_multi, classifier, classifier_plan, classifier_using, elementwise,
        layer_norm_backward, layer_norm_forward, row_plan_occupancy, row_scale, AdamCoef,
        AdamHyper, AdamTensor, ClassifierKernel, Elementwise, EwOp, LayerNormBackward,
        LayerNormForward, RowPlan, RowScale,
    };
    pub use crate::kernels::{grid, per_row, Kernel, Kernels, Template};
    pub use crate::launch;
    pub use crate::ops::last_dim_rows;
    pub use crate::precision::{gemm_at, Gemm, Operand};
    pub use crate::raw::{
        AttentionBackward, AttentionForward, AttentionShape, Bhtd, Classifier, FResult, FloatType,
        FusedError,
    };
    pub use crate::storage::{download, upload};
    /// cuDNN's fused attention.
    pub mod cudnn_attention {
        pub use crate::cudnn_attention::{backward, cudnn_report, cudnn_version, forward};
    }
    /// The NVRTC flash-attention kernels.
    pub mod flash_attention {
        pub use crate::flash_attention::{backward, forward};
    }
}
