//! Gather CPU kernels: reads along one dim at indices (gather, index-select, embedding) and
//! the scatter-adds of their gradients, over a shard of the addressed dim.

use ndarray::{ArrayD, IxDyn};

use super::float_input;
use super::{checked, CpuBackend};
use crate::element::{FloatElement, TensorElement};
use crate::op::{kernel_err, GatherKernels, IndexShard, OutSpec};
use crate::storage::CpuArray;
use crate::Result;

/// How the index array addresses the dim: one index per element (torch.gather) or one per
/// position along the dim (index-select, embedding; any ids shape, flattened).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Addressing {
    PerElement,
    PerPosition,
}

/// (outer, n, inner) of `dim` in `shape`.
fn lanes(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape.iter().take(dim).product();
    let inner = shape.iter().skip(dim + 1).product();
    (outer, shape.get(dim).copied().unwrap_or(1), inner)
}

/// The walk over the elements of the indexed side (the read's output, the scatter's source)
/// of `numel` elements, mapping each to its element of the dense side (the read's input, the
/// scatter's output) of shape `dense` through the indices along `dim`.
struct Walk<'a> {
    op: &'static str,
    ids: &'a [i64],
    addressing: Addressing,
    shard: IndexShard,
    /// Index positions along the dim, the elements after it, and the dense side's length of it.
    n: usize,
    inner: usize,
    dense_n: usize,
}

impl<'a> Walk<'a> {
    fn new(
        op: &'static str,
        ids: &'a [i64],
        (dim, addressing, shard): (usize, Addressing, IndexShard),
        numel: usize,
        dense: &[usize],
    ) -> Result<Walk<'a>> {
        let (outer, dense_n, inner) = lanes(dense, dim);
        let n = match addressing {
            Addressing::PerPosition => ids.len(),
            Addressing::PerElement => numel.checked_div(outer * inner).unwrap_or(0),
        };
        let fits = n.checked_mul(outer * inner) == Some(numel)
            && (addressing == Addressing::PerPosition || ids.len() == numel);
        if !fits {
            return Err(kernel_err(
                op,
                format!("{} indices do not address {numel} elements", ids.len()),
            ));
        }
        Ok(Walk {
            op,
            ids,
            addressing,
            shard,
            n,
            inner,
            dense_n,
        })
    }

    /// The dense element of indexed element `l`: None when its index is another rank's, an
    /// error outside `0..shard.total`.
    fn dense_at(&self, l: usize) -> Result<Option<usize>> {
        let (j, i) = ((l / self.inner) % self.n, l % self.inner);
        let id = match self.addressing {
            Addressing::PerElement => self.ids[l],
            Addressing::PerPosition => self.ids[j],
        };
        let local = match usize::try_from(id) {
            Ok(g) if g < self.shard.total => g.checked_sub(self.shard.start),
            _ => {
                return Err(kernel_err(
                    self.op,
                    format!("index {id} out of range 0..{}", self.shard.total),
                ))
            }
        };
        let outer = l / (self.inner * self.n);
        Ok(local
            .filter(|&r| r < self.dense_n)
            .map(|r| (outer * self.dense_n + r) * self.inner + i))
    }
}

fn take_t<T: TensorElement>(
    op: &'static str,
    x: &ArrayD<T>,
    ids: &ArrayD<i64>,
    dim: usize,
    addressing: Addressing,
    shard: IndexShard,
    out_shape: &[usize],
) -> Result<ArrayD<T>> {
    let (x, ids) = (x.as_standard_layout(), ids.as_standard_layout());
    let (Some(xs), Some(is)) = (x.as_slice(), ids.as_slice()) else {
        return Err(kernel_err(op, "non-contiguous input".into()));
    };
    let numel: usize = out_shape.iter().product();
    let walk = Walk::new(op, is, (dim, addressing, shard), numel, x.shape())?;
    let mut out = vec![T::from_f64(0.0); numel];
    for (l, o) in out.iter_mut().enumerate() {
        if let Some(at) = walk.dense_at(l)? {
            *o = xs[at];
        }
    }
    ArrayD::from_shape_vec(IxDyn(out_shape), out).map_err(|e| kernel_err(op, e.to_string()))
}

/// `x` read at `ids` along `dim` into an array of `out_shape` (zeros for other ranks' ids).
pub(crate) fn take(
    op: &'static str,
    x: &CpuArray,
    ids: &CpuArray,
    dim: usize,
    addressing: Addressing,
    shard: IndexShard,
    out_shape: &[usize],
) -> Result<CpuArray> {
    let CpuArray::I64(ids) = ids else {
        return Err(kernel_err(op, "needs i64 indices".into()));
    };
    Ok(match x {
        CpuArray::F32(x) => CpuArray::F32(take_t(op, x, ids, dim, addressing, shard, out_shape)?),
        CpuArray::F64(x) => CpuArray::F64(take_t(op, x, ids, dim, addressing, shard, out_shape)?),
        CpuArray::I64(x) => CpuArray::I64(take_t(op, x, ids, dim, addressing, shard, out_shape)?),
        x => return Err(float_input(op, x)),
    })
}

fn put_t<F: FloatElement>(
    op: &'static str,
    ids: &ArrayD<i64>,
    src: &ArrayD<F>,
    dim: usize,
    addressing: Addressing,
    shard: IndexShard,
    out_shape: &[usize],
) -> Result<ArrayD<F>> {
    let (src, ids) = (src.as_standard_layout(), ids.as_standard_layout());
    let (Some(ss), Some(is)) = (src.as_slice(), ids.as_slice()) else {
        return Err(kernel_err(op, "non-contiguous input".into()));
    };
    let walk = Walk::new(op, is, (dim, addressing, shard), ss.len(), out_shape)?;
    let mut out = vec![F::from_f64(0.0); out_shape.iter().product()];
    for (l, &v) in ss.iter().enumerate() {
        if let Some(at) = walk.dense_at(l)? {
            out[at] += v;
        }
    }
    ArrayD::from_shape_vec(IxDyn(out_shape), out).map_err(|e| kernel_err(op, e.to_string()))
}

/// Zeros of `out_shape` plus `src` added at `ids` along `dim` (other ranks' ids skipped).
pub(crate) fn put(
    op: &'static str,
    ids: &CpuArray,
    src: &CpuArray,
    dim: usize,
    addressing: Addressing,
    shard: IndexShard,
    out_shape: &[usize],
) -> Result<CpuArray> {
    Ok(match (ids, src) {
        (CpuArray::I64(i), CpuArray::F32(s)) => {
            CpuArray::F32(put_t(op, i, s, dim, addressing, shard, out_shape)?)
        }
        (CpuArray::I64(i), CpuArray::F64(s)) => {
            CpuArray::F64(put_t(op, i, s, dim, addressing, shard, out_shape)?)
        }
        _ => return Err(kernel_err(op, "needs i64 indices and a float src".into())),
    })
}

impl GatherKernels for CpuBackend {
    fn gather(
        &self,
        x: &CpuArray,
        index: &CpuArray,
        dim: usize,
        shard: IndexShard,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        let op = "gather";
        let y = take(
            op,
            x,
            index,
            dim,
            Addressing::PerElement,
            shard,
            out.shape.dims(),
        )?;
        checked(op, y, out)
    }
    fn scatter_add(
        &self,
        index: &CpuArray,
        src: &CpuArray,
        dim: usize,
        shard: IndexShard,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        let op = "scatter_add";
        let y = put(
            op,
            index,
            src,
            dim,
            Addressing::PerElement,
            shard,
            out.shape.dims(),
        )?;
        checked(op, y, out)
    }
    fn index_select(
        &self,
        x: &CpuArray,
        ids: &CpuArray,
        dim: usize,
        shard: IndexShard,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        let op = "index_select";
        let y = take(
            op,
            x,
            ids,
            dim,
            Addressing::PerPosition,
            shard,
            out.shape.dims(),
        )?;
        checked(op, y, out)
    }
    fn index_add(
        &self,
        ids: &CpuArray,
        src: &CpuArray,
        dim: usize,
        shard: IndexShard,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        let op = "index_add";
        let y = put(
            op,
            ids,
            src,
            dim,
            Addressing::PerPosition,
            shard,
            out.shape.dims(),
        )?;
        checked(op, y, out)
    }
}
