//! Tensors for OxiFlow: one `Tensor` type, local or global (a local piece + `GlobalLayout` +
//! the rank's runtime `Context`), CPU storage on ndarray (rayon kernels, matrixmultiply), a
//! device seam for CUDA storage, eager op dispatch with SBP signature inference and boxing, and
//! counter-based random creation ops.
//!
//! ```text
//! Tensor::randn_global([4, 5], seed, F32, &placement, Sbp::S(0))?   // each rank fills its rows
//!     .matmul(&w)?                                                 // infer, box, kernel
//!     .to_global(&placement, Sbp::B)?                              // boxing
//!     .to_ndarray::<f32>()?                                        // whole value on the host
//! ```

pub mod arena;
pub mod autograd;
pub mod backend;
mod bucket;
pub mod capture;
mod context;
mod cpu;
mod creation;
mod device;
mod device_slot;
mod dispatch;
mod element;
mod error;
mod executor;
pub mod explain;
mod gather_bucket;
mod global;
mod grad_mode;
mod host_read;
mod in_place;
mod init;
mod inprocess;
pub mod memory;
mod methods;
mod observe;
mod op;
mod op_trace;
pub mod rng;
mod storage;
mod tensor;

pub use autograd::{install_grad_hook, recompute, GradHookGuard, GradReadyHook};
pub use bucket::{bucket_fits, reduce_bucket, start_bucket, BucketTarget, PendingBucket};
pub use context::{Context, ContextGuard};
pub use cpu::CpuBackend;
pub use device::{
    awaits_collectives, capture_graph, copy_storage, duplicate_storage, graph_capture_refusal,
    order_after_collectives, register_device_backend, DeviceBackend, DeviceGraph,
};
pub use dispatch::{dispatch, dispatch_multi};
pub use element::{FloatElement, TensorElement};
pub use error::{Result, TensorError};
pub use executor::{register_op_executor, OpExecutor};
pub use gather_bucket::{gather_bucket, gather_fits};
pub use grad_mode::{is_grad_enabled, no_grad, set_grad_enabled, GradModeGuard};
pub use host_read::PendingRead;
pub use in_place::{dispatch_into, run_local_into, BoundPiece};
pub use init::{init_from_env, init_with_env, init_with_world, register_nccl_world, NcclWorldJoin};
pub use inprocess::run_ranks;
pub use methods::loss::vocab_parallel_cross_entropy;
pub use op::custom;
pub use op::{
    broadcast_shapes, BinaryOp, Dims, ElementwiseOp, EmbeddingOp, F64Bits, LayoutOp, LocalAt,
    LossOp, MatmulOp, MatmulProduct, NormOp, Op, OutSpec, ReductionOp, ScalarOp, SoftmaxOp,
    UnaryOp, ViewOf,
};
pub use op::{AttentionOp, DropoutOp};
pub use op::{
    BackendId, Extern, ExternOp, Grad, Inferred, KernelBackend, KernelFn, KernelIo, Kernels,
    MetaError, MetaResult, Peers, Saves, ScratchFn,
};
pub use op::{ClassShard, GatherOp, IndexShard, MaskOp, RotaryOp, Triangle};
pub use storage::{CpuArray, Device, DeviceStorage, HostRead, ReadDone, Storage};
pub use tensor::{AutogradMeta, GradFn, Tensor, TensorMeta};

pub use oxiflow_dtype::{bf16, f16, DType, MatmulPrecision};
pub use oxiflow_placement::{DeviceType, Placement};
pub use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceOp, Sbp, Shape};
