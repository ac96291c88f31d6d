//! The CUDA kernels of every op family, one file per family, each implementing that family's
//! kernel trait for [`CudaKernels`] (NVRTC kernels from `kernels.rs`, cuBLAS for matmuls). They
//! write into output pieces the executor allocated from the runtime's pool (`alloc` below);
//! scratch pieces come from the same allocator.

mod attention;
mod custom;
mod dropout;
pub(crate) mod elementwise;
mod gather;
mod layout;
mod loss;
mod lt;
mod mask;
mod matmul;
mod norm;
mod reduction;
mod residual_layer_norm;
mod rms_norm;
mod rotary;
mod softmax;

use std::sync::Arc;

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use super::copy::cast;
use super::storage::CudaStorage;
use super::{derr, CudaRuntime};
use oxiflow_tensor::Result;
use oxiflow_tensor::{KernelBackend, OutSpec};

pub(crate) use layout::permute;
pub use residual_layer_norm::residual_layer_norm_forward;

/// The CUDA backend's kernels on the process's runtime: the kernel-side backend an extern op's
/// CUDA kernels are written for (`oxiflow_tensor::Kernels::with::<Op, CudaKernels>`).
pub struct CudaKernels {
    pub(crate) rt: Arc<CudaRuntime>,
}

impl CudaKernels {
    /// The runtime the kernels launch on (its compute stream, its allocator).
    pub fn runtime(&self) -> &Arc<CudaRuntime> {
        &self.rt
    }
}

impl KernelBackend for CudaKernels {
    const NAME: &'static str = "cuda";
    type Piece = CudaStorage;
    type Out = CudaStorage;
    /// An uninitialised piece from the runtime's caching pool.
    fn alloc(&self, spec: &OutSpec) -> Result<CudaStorage> {
        if spec.shape.checked_numel().is_none() {
            return Err(derr(
                "alloc",
                format!("{} {} overflows", spec.dtype, spec.shape),
            ));
        }
        CudaStorage::alloc(&self.rt, spec.dtype, spec.shape.clone())
    }
    fn out_spec(&self, out: &CudaStorage) -> OutSpec {
        OutSpec {
            shape: out.shape.clone(),
            dtype: out.dtype,
        }
    }
    fn finish(&self, out: CudaStorage) -> CudaStorage {
        out
    }
    fn piece_spec(&self, x: &CudaStorage) -> OutSpec {
        self.out_spec(x)
    }
    /// The same block from element `start` under `spec`'s shape (no copy).
    fn viewed(&self, x: &CudaStorage, start: usize, spec: &OutSpec) -> Result<CudaStorage> {
        let range = (spec.dtype == x.dtype)
            .then(|| x.range(start, &spec.shape))
            .flatten();
        range.ok_or_else(|| {
            derr(
                "view",
                format!(
                    "cannot view elements from {start} of {} {} as {} {}",
                    x.dtype, x.shape, spec.dtype, spec.shape
                ),
            )
        })
    }
}

impl CudaKernels {
    /// `x` itself, or its f32 copy when it is 16-bit (for kernels that compute 16-bit data
    /// through f32).
    pub fn widened(&self, op: &'static str, x: &CudaStorage) -> Result<CudaStorage> {
        if !x.dtype.is_half() {
            return Ok(x.clone());
        }
        let w = self.alloc(&OutSpec {
            shape: x.shape.clone(),
            dtype: DType::F32,
        })?;
        cast(
            &self.rt,
            op,
            (x.dtype, x.ptr()),
            (DType::F32, w.ptr()),
            x.numel(),
        )?;
        Ok(w)
    }

    /// The buffer a kernel computing through f32 writes for output `out`: itself, or an f32
    /// one when 16-bit ([`CudaKernels::narrow`] rounds it into `out`).
    pub fn wide_out(&self, out: &CudaStorage) -> Result<CudaStorage> {
        if !out.dtype.is_half() {
            return Ok(out.clone());
        }
        self.alloc(&OutSpec {
            shape: out.shape.clone(),
            dtype: DType::F32,
        })
    }

    /// Rounds `wide` into `out` when they differ.
    pub fn narrow(&self, op: &'static str, wide: &CudaStorage, out: &CudaStorage) -> Result<()> {
        if wide.dtype == out.dtype {
            return Ok(());
        }
        cast(
            &self.rt,
            op,
            (wide.dtype, wide.ptr()),
            (out.dtype, out.ptr()),
            out.numel(),
        )
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
pub fn last_dim_rows(x: &CudaStorage) -> (usize, usize) {
    let h = x.shape.dims().last().copied().unwrap_or(1);
    (x.numel().checked_div(h).unwrap_or(0), h)
}

/// A typed error unless `out` holds as many elements as `x` (and, with `same_dtype`, its
/// dtype): the kernels index both with one count.
fn fits(op: &'static str, x: &CudaStorage, out: &CudaStorage, same_dtype: bool) -> Result<()> {
    fits_as(op, x, out, same_dtype, ("piece", "does not fit the output"))
}

/// As [`fits`], the error saying `{lead} x {link} out` (each as its dtype and shape).
fn fits_as(
    op: &'static str,
    x: &CudaStorage,
    out: &CudaStorage,
    same_dtype: bool,
    (lead, link): (&str, &str),
) -> Result<()> {
    if x.numel() != out.numel() || (same_dtype && x.dtype != out.dtype) {
        return Err(derr(
            op,
            format!(
                "{lead} {} {} {link} {} {}",
                x.dtype, x.shape, out.dtype, out.shape
            ),
        ));
    }
    Ok(())
}
