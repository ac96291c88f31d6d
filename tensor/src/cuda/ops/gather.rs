//! Gather CUDA kernels, written into the executor's output piece: reads along one dim at indices (gather, index-select, embedding) and
//! the scatter-adds of their gradients (atomic adds), over a shard of the addressed dim.

use oxiflow_dtype::DType;

use super::super::copy::{cast, fill};
use super::super::derr;
use super::super::kernels::{grid, launch, Template};
use super::super::storage::CudaStorage;
use super::{float_only, lanes, CudaKernels};
use crate::op::{GatherKernels, IndexShard};
use crate::Result;

/// The kernels' index arguments: (positions along the dim, shard start, shard total), checked
/// so that `numel` = outer * positions * inner, for i64 `ids`.
fn index_args(
    op: &'static str,
    ids: &CudaStorage,
    per_elem: bool,
    numel: usize,
    outer_inner: usize,
    shard: IndexShard,
) -> Result<(i64, i64, i64)> {
    if ids.dtype != DType::I64 {
        return Err(derr(op, "needs i64 indices"));
    }
    let n_ids = ids.numel();
    let n = if per_elem {
        numel.checked_div(outer_inner).unwrap_or(0)
    } else {
        n_ids
    };
    if n.checked_mul(outer_inner) != Some(numel) || (per_elem && n_ids != numel) {
        return Err(derr(
            op,
            format!("{n_ids} indices do not address {numel} elements"),
        ));
    }
    Ok((n as i64, shard.start as i64, shard.total as i64))
}

/// How indices address a dim: which dim, one index per element (torch.gather) or per
/// position along it, and this rank's shard of it.
pub(super) struct Along {
    pub dim: usize,
    pub per_elem: bool,
    pub shard: IndexShard,
}

/// `x` read at `ids` along a dim into `out`.
pub(super) fn take(
    k: &CudaKernels,
    op: &'static str,
    x: &CudaStorage,
    ids: &CudaStorage,
    along: Along,
    out: &CudaStorage,
) -> Result<()> {
    let Along {
        dim,
        per_elem,
        shard,
    } = along;
    if out.dtype != x.dtype || dim >= x.shape.ndim() {
        return Err(derr(
            op,
            format!(
                "output {} {} for {} {}",
                out.dtype, out.shape, x.dtype, x.shape
            ),
        ));
    }
    let (outer, nx, inner) = lanes(&x.shape, dim);
    let n = out.numel();
    let (ni, st, tot) = index_args(op, ids, per_elem, n, outer * inner, shard)?;
    let y = out;
    if n > 0 {
        let (nn, inn, nxx, pe) = (n as i64, inner as i64, nx as i64, per_elem as i32);
        let (xp, ip, yp) = (x.ptr(), ids.ptr(), y.ptr());
        let name = Template::Take.at(x.dtype);
        launch!(k.rt, op, name, grid(n); nn, ni, inn, nxx, st, tot, pe, xp, ip, yp)?;
    }
    Ok(())
}

/// Zeros plus `src` added at `ids` along a dim, into `out`.
pub(super) fn put(
    k: &CudaKernels,
    op: &'static str,
    ids: &CudaStorage,
    src: &CudaStorage,
    along: Along,
    out: &CudaStorage,
) -> Result<()> {
    let Along {
        dim,
        per_elem,
        shard,
    } = along;
    float_only(op, src.dtype)?;
    if src.dtype.is_half() && out.dtype == src.dtype {
        // The atomic scatter-add accumulates in f32 scratch pieces, rounded once into `out`.
        let src32 = CudaStorage::alloc(&k.rt, DType::F32, src.shape.clone())?;
        cast(
            &k.rt,
            op,
            (src.dtype, src.ptr()),
            (DType::F32, src32.ptr()),
            src.numel(),
        )?;
        let y32 = CudaStorage::alloc(&k.rt, DType::F32, out.shape.clone())?;
        let along = Along {
            dim,
            per_elem,
            shard,
        };
        put(k, op, ids, &src32, along, &y32)?;
        return cast(
            &k.rt,
            op,
            (DType::F32, y32.ptr()),
            (out.dtype, out.ptr()),
            out.numel(),
        );
    }
    if out.dtype != src.dtype || dim >= out.shape.ndim() {
        return Err(derr(
            op,
            format!(
                "output {} {} for src {} {}",
                out.dtype, out.shape, src.dtype, src.shape
            ),
        ));
    }
    let (outer, ny, inner) = lanes(&out.shape, dim);
    let n = src.numel();
    let (ni, st, tot) = index_args(op, ids, per_elem, n, outer * inner, shard)?;
    let y = out;
    fill(&k.rt, op, src.dtype, y.ptr(), y.numel(), 0.0, 0)?;
    if n > 0 {
        let (nn, inn, nyy, pe) = (n as i64, inner as i64, ny as i64, per_elem as i32);
        let (ip, sp, yp) = (ids.ptr(), src.ptr(), y.ptr());
        let name = Template::Put.at(src.dtype);
        launch!(k.rt, op, name, grid(n); nn, ni, inn, nyy, st, tot, pe, ip, sp, yp)?;
    }
    Ok(())
}

impl GatherKernels for CudaKernels {
    fn gather(
        &self,
        x: &CudaStorage,
        index: &CudaStorage,
        dim: usize,
        shard: IndexShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        take(
            self,
            "gather",
            x,
            index,
            Along {
                dim,
                per_elem: true,
                shard,
            },
            out,
        )
    }
    fn scatter_add(
        &self,
        index: &CudaStorage,
        src: &CudaStorage,
        dim: usize,
        shard: IndexShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        put(
            self,
            "scatter_add",
            index,
            src,
            Along {
                dim,
                per_elem: true,
                shard,
            },
            out,
        )
    }
    fn index_select(
        &self,
        x: &CudaStorage,
        ids: &CudaStorage,
        dim: usize,
        shard: IndexShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        take(
            self,
            "index_select",
            x,
            ids,
            Along {
                dim,
                per_elem: false,
                shard,
            },
            out,
        )
    }
    fn index_add(
        &self,
        ids: &CudaStorage,
        src: &CudaStorage,
        dim: usize,
        shard: IndexShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        put(
            self,
            "index_add",
            ids,
            src,
            Along {
                dim,
                per_elem: false,
                shard,
            },
            out,
        )
    }
}
