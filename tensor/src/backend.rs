//! The backend API: what a device backend crate (`oxiflow-cuda`) builds on beside the root's
//! seams (`DeviceBackend`, `DeviceStorage`, `OpExecutor` and their registries, `KernelBackend`,
//! `OutSpec`). A backend implements every op family's kernel trait (together [`Backend`], so a
//! missing kernel fails to compile), runs an op through the one executor ([`execute`],
//! [`execute_into`]) and reports errors as the core does ([`kernel_err`]).

use smallvec::SmallVec;

use crate::op::{Op, OutSpec};
use crate::Result;

pub use crate::cpu::{array_of_host_piece, host_piece_of, PAR_THRESHOLD};
pub use crate::op::{
    composed_layer_norm_grads, kernel_err, meta_err, need_float, need_i64, norm_stats_dtype,
    scratch, Addressing, Along, AttentionKernels, Backend, CoreKernels, DropoutKernels,
    ElementwiseKernels, Extremum, GatherKernels, LayoutKernels, LossKernels, MaskKernels,
    MatmulKernels, NormKernels, OpFamily, ReductionKernels, RmsNormKernels, RotaryKernels,
    RunKernels, SoftmaxKernels,
};

/// Runs `op`'s kernels on backend `b` over the input pieces `x`, allocating one output per spec
/// with the backend's allocator (a view op returns a view of its input).
pub fn execute<B: Backend>(
    op: &Op,
    b: &B,
    x: &[&B::Piece],
    specs: &[OutSpec],
) -> Result<SmallVec<[B::Piece; 1]>> {
    op.execute(b, x, specs)
}

/// Runs `op`'s kernels on backend `b` into given output buffers (one per output, of its shape
/// and dtype), where an arena placed them; a view op has no kernel and is an error here.
pub fn execute_into<B: Backend>(op: &Op, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
    op.execute_into(b, x, out)
}
