//! Gather CUDA kernels, written into the executor's output piece: reads along one dim at indices (gather, index-select, embedding) and
//! the scatter-adds of their gradients (atomic adds), over a shard of the addressed dim.

use oxiflow_dtype::DType;

use super::super::copy::fill;
use super::super::derr;
use super::super::kernels::{grid, launch, Kernel, Template};
use super::super::storage::CudaStorage;
use super::{float_only, lanes, CudaKernels};
use oxiflow_tensor::backend::{Addressing, Along, GatherKernels};
use oxiflow_tensor::Result;

/// The kernels' arguments of an index walk, checked for `numel` elements on the indexed side,
/// i64 `ids`, and the dense side `dense` of `data`'s dtype in `out`: (positions along the dim,
/// elements after it, the dense side's length of it, shard start, shard total, whether one
/// index per element).
fn index_args(
    op: &'static str,
    ids: &CudaStorage,
    along: Along,
    numel: usize,
    (dense, data, out): (&CudaStorage, &CudaStorage, &CudaStorage),
) -> Result<Walk> {
    let Along {
        dim,
        addressing,
        shard,
    } = along;
    if out.dtype != data.dtype || dim >= dense.shape.ndim() {
        return Err(derr(
            op,
            format!(
                "output {} {} for {} {}",
                out.dtype, out.shape, data.dtype, data.shape
            ),
        ));
    }
    if ids.dtype != DType::I64 {
        return Err(derr(op, "needs i64 indices"));
    }
    let (outer, nd, inner) = lanes(&dense.shape, dim);
    let per_elem = addressing == Addressing::PerElement;
    let n_ids = ids.numel();
    let n = if per_elem {
        numel.checked_div(outer * inner).unwrap_or(0)
    } else {
        n_ids
    };
    if n.checked_mul(outer * inner) != Some(numel) || (per_elem && n_ids != numel) {
        return Err(derr(
            op,
            format!("{n_ids} indices do not address {numel} elements"),
        ));
    }
    Ok((
        n as i64,
        inner as i64,
        nd as i64,
        shard.start as i64,
        shard.total as i64,
        per_elem as i32,
    ))
}

/// The arguments of an index walk (see [`index_args`]).
type Walk = (i64, i64, i64, i64, i64, i32);

impl CudaKernels {
    /// Launches `kernel` over `n` elements (none when `n` is 0) with the walk's arguments and
    /// the kernel's three pointers.
    fn walk(
        &self,
        op: &'static str,
        kernel: Kernel,
        n: usize,
        (ni, inn, nd, st, tot, pe): Walk,
        [p0, p1, p2]: [u64; 3],
    ) -> Result<()> {
        if n > 0 {
            let nn = n as i64;
            launch!(self.rt, op, kernel, grid(n); nn, ni, inn, nd, st, tot, pe, p0, p1, p2)?;
        }
        Ok(())
    }
}

impl GatherKernels for CudaKernels {
    fn take(
        &self,
        op: &'static str,
        x: &CudaStorage,
        ids: &CudaStorage,
        along: Along,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let n = out.numel();
        let walk = index_args(op, ids, along, n, (x, x, out))?;
        let ptrs = [x.ptr(), ids.ptr(), out.ptr()];
        self.walk(op, Template::Take.at(x.dtype), n, walk, ptrs)
    }

    fn put(
        &self,
        op: &'static str,
        ids: &CudaStorage,
        src: &CudaStorage,
        along: Along,
        out: &mut CudaStorage,
    ) -> Result<()> {
        float_only(op, src.dtype)?;
        if src.dtype.is_half() && out.dtype == src.dtype {
            // The atomic scatter-add accumulates in f32 scratch pieces, rounded once into `out`.
            let src32 = self.widened(op, src)?;
            let mut y32 = self.wide_out(out)?;
            self.put(op, ids, &src32, along, &mut y32)?;
            return self.narrow(op, &y32, out);
        }
        let n = src.numel();
        let walk = index_args(op, ids, along, n, (out, src, out))?;
        fill(&self.rt, op, src.dtype, out.ptr(), out.numel(), 0.0, 0)?;
        let ptrs = [ids.ptr(), src.ptr(), out.ptr()];
        self.walk(op, Template::Put.at(src.dtype), n, walk, ptrs)
    }
}
