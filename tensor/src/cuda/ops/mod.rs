//! The CUDA kernels of every op family, one file per family, each implementing that family's
//! kernel trait for [`CudaKernels`] (NVRTC kernels from `kernels.rs`, cuBLAS for matmuls).

mod attention;
mod dropout;
mod elementwise;
mod embedding;
mod gather;
mod layout;
mod loss;
mod mask;
mod matmul;
mod norm;
mod reduction;
mod rms_norm;
mod rotary;
mod softmax;

use std::sync::Arc;

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use super::storage::CudaStorage;
use super::{derr, CudaRuntime};
use crate::op::{KernelBackend, OutSpec};
use crate::Result;

pub(crate) use layout::permute;

/// The CUDA backend's kernels on the process's runtime.
pub(crate) struct CudaKernels {
    pub rt: Arc<CudaRuntime>,
}

impl KernelBackend for CudaKernels {
    type Piece = CudaStorage;
}

impl CudaKernels {
    /// An uninitialised piece of `out`'s shape and dtype.
    fn alloc(&self, out: &OutSpec) -> Result<CudaStorage> {
        CudaStorage::alloc(&self.rt, out.dtype, out.shape.clone())
    }
}

fn float_only(op: &'static str, d: DType) -> Result<()> {
    if d == DType::I64 {
        return Err(derr(op, "needs a float input, got i64"));
    }
    Ok(())
}

/// (outer, n, inner) of `dim` in `shape`.
fn lanes(shape: &Shape, dim: usize) -> (usize, usize, usize) {
    let d = shape.dims();
    let outer: usize = d.iter().take(dim).product();
    let inner: usize = d.iter().skip(dim + 1).product();
    (outer, d.get(dim).copied().unwrap_or(1), inner)
}

/// (rows, last-dim length) of a piece viewed as rows of its last dim.
fn last_dim_rows(x: &CudaStorage) -> (usize, usize) {
    let h = x.shape.dims().last().copied().unwrap_or(1);
    (x.numel().checked_div(h).unwrap_or(0), h)
}
