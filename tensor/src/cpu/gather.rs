//! Gather CPU kernels, written into the executor's output buffer: reads along one dim at indices (gather, index-select, embedding) and
//! the scatter-adds of their gradients, over a shard of the addressed dim.

use ndarray::ArrayD;

use super::{out_as, CpuBackend};
use crate::element::{FloatElement, TensorElement};
use crate::op::{kernel_err, Addressing, Along, GatherKernels, IndexShard};
use crate::storage::CpuArray;
use crate::{with_array, Result};

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
        Along {
            dim,
            addressing,
            shard,
        }: Along,
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

/// Runs `f` on the values of `x` and of `out` (both row-major) and the [`Walk`] of `ids`
/// `along` a dim: from `out` (a read's output) into `x`, or with `scatter` from `x` (a
/// scatter's source) into `out`.
fn walked<T: TensorElement>(
    op: &'static str,
    x: &ArrayD<T>,
    ids: &ArrayD<i64>,
    along: Along,
    out: &mut ArrayD<T>,
    scatter: bool,
    f: impl FnOnce(&[T], &Walk<'_>, &mut [T]) -> Result<()>,
) -> Result<()> {
    let (x, ids) = (x.as_standard_layout(), ids.as_standard_layout());
    let (Some(xs), Some(is)) = (x.as_slice(), ids.as_slice()) else {
        return Err(kernel_err(op, "non-contiguous input".into()));
    };
    let walk = if scatter {
        Walk::new(op, is, along, xs.len(), out.shape())?
    } else {
        Walk::new(op, is, along, out.len(), x.shape())?
    };
    let os = out
        .as_slice_mut()
        .ok_or_else(|| kernel_err(op, "non-contiguous output".into()))?;
    f(xs, &walk, os)
}

fn take_t<T: TensorElement>(
    op: &'static str,
    x: &ArrayD<T>,
    ids: &ArrayD<i64>,
    along: Along,
    out: &mut ArrayD<T>,
) -> Result<()> {
    walked(op, x, ids, along, out, false, |xs, walk, os| {
        for (l, o) in os.iter_mut().enumerate() {
            *o = match walk.dense_at(l)? {
                Some(at) => xs[at],
                None => T::from_f64(0.0),
            };
        }
        Ok(())
    })
}

fn put_t<F: FloatElement>(
    op: &'static str,
    ids: &ArrayD<i64>,
    src: &ArrayD<F>,
    along: Along,
    out: &mut ArrayD<F>,
) -> Result<()> {
    walked(op, src, ids, along, out, true, |ss, walk, os| {
        os.fill(F::from_f64(0.0));
        for (l, &v) in ss.iter().enumerate() {
            if let Some(at) = walk.dense_at(l)? {
                os[at] += v;
            }
        }
        Ok(())
    })
}

impl GatherKernels for CpuBackend {
    fn take(
        &self,
        op: &'static str,
        x: &CpuArray,
        ids: &CpuArray,
        along: Along,
        out: &mut CpuArray,
    ) -> Result<()> {
        let CpuArray::I64(ids) = ids else {
            return Err(kernel_err(op, "needs i64 indices".into()));
        };
        with_array!(x, a => take_t(op, a, ids, along, out_as(op, out)?))
    }
    fn put(
        &self,
        op: &'static str,
        ids: &CpuArray,
        src: &CpuArray,
        along: Along,
        out: &mut CpuArray,
    ) -> Result<()> {
        with_floats!(op, "needs i64 indices and a float src"; (src) as (s), ids => I64(i) => {
            put_t(op, i, s, along, out_as(op, out)?)
        })
    }
}
