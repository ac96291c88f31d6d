//! Reduction CPU kernels: sum/mean/max/min over dims and sum-to-shape (the reverse of
//! broadcasting). The last reduction writes into the executor's output buffer (viewed with the
//! reduced dims kept as size 1); reductions over several dims fold the inner ones first.

use ndarray::{ArrayD, ArrayViewD, ArrayViewMutD, CowArray, IxDyn, Zip};
use oxiflow_sbp::ReduceKind;

use super::{float_input, out_as, CpuBackend};
use crate::element::TensorElement;
use crate::op::{kernel_err, Extremum, ReductionKernels};
use crate::storage::CpuArray;
use crate::Result;

fn combine<T: TensorElement>(kind: ReduceKind) -> impl Fn(T, T) -> T + Copy {
    move |acc: T, x: T| match kind {
        ReduceKind::Max => {
            if x > acc {
                x
            } else {
                acc
            }
        }
        ReduceKind::Min => {
            if x < acc {
                x
            } else {
                acc
            }
        }
        ReduceKind::Sum | ReduceKind::Mean => acc + x,
    }
}

fn identity<T: TensorElement>(kind: ReduceKind) -> T {
    match kind {
        ReduceKind::Max => T::lowest(),
        ReduceKind::Min => T::highest(),
        ReduceKind::Sum | ReduceKind::Mean => T::from_f64(0.0),
    }
}

/// `a` reduced over dim `d` into `out` (`a`'s shape with `d` of size 1), combining whole rows
/// of the dims after `d` at a time (contiguous in a standard-layout `a`).
fn reduce_axis_into<T: TensorElement>(
    a: ArrayViewD<'_, T>,
    d: usize,
    kind: ReduceKind,
    out: ArrayViewMutD<'_, T>,
) -> Option<()> {
    let shape = a.shape();
    let outer: usize = shape[..d].iter().product();
    let inner: usize = shape[d + 1..].iter().product();
    let n = shape[d];
    let a3 = a.into_shape_with_order((outer, n, inner)).ok()?;
    let mut o2 = out.into_shape_with_order((outer, inner)).ok()?;
    let (f, init) = (combine::<T>(kind), identity::<T>(kind));
    for (mut o, block) in o2.outer_iter_mut().zip(a3.outer_iter()) {
        if inner == 1 {
            o[0] = block.iter().fold(init, |acc, &x| f(acc, x));
            continue;
        }
        o.fill(init);
        for row in block.outer_iter() {
            Zip::from(&mut o).and(&row).for_each(|o, &x| *o = f(*o, x));
        }
    }
    Some(())
}

/// `a` reduced over the sorted, distinct `dims` into `out`, whose element count is that of `a`
/// with the dims kept as size 1 (with or without those unit dims); None when it is not.
fn reduce_into<T: TensorElement>(
    a: &ArrayD<T>,
    dims: &[usize],
    kind: ReduceKind,
    out: &mut ArrayD<T>,
) -> Option<()> {
    if dims.iter().any(|&d| d >= a.ndim()) {
        return None;
    }
    let a = a.as_standard_layout();
    let Some((&first, rest)) = dims.split_first() else {
        // No dims: the identity.
        let src = a.as_slice()?;
        let dst = out.as_slice_mut().filter(|o| o.len() == src.len())?;
        dst.copy_from_slice(src);
        return Some(());
    };
    // Every dim but the first into a temporary (kept as size 1), innermost first.
    let mut cur: CowArray<'_, T, IxDyn> = a.view().into();
    for &d in rest.iter().rev() {
        let mut kept = cur.shape().to_vec();
        kept[d] = 1;
        let mut r = ArrayD::from_elem(IxDyn(&kept), T::from_f64(0.0));
        reduce_axis_into(cur.view(), d, kind, r.view_mut())?;
        cur = r.into();
    }
    let mut kept = cur.shape().to_vec();
    kept[first] = 1;
    let o = out.view_mut().into_shape_with_order(IxDyn(&kept)).ok()?;
    reduce_axis_into(cur.view(), first, kind, o)
}

/// Sum, max or min over `dims` into `out`, scaled by 1 / `count` when given (a mean).
fn reduce(
    op: &'static str,
    a: &CpuArray,
    dims: &[usize],
    kind: ReduceKind,
    count: Option<usize>,
    out: &mut CpuArray,
) -> Result<()> {
    let mut sorted: Vec<usize> = dims.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let done = match a {
        CpuArray::F32(x) => {
            let o = out_as::<f32>(op, out)?;
            reduce_into(x, &sorted, kind, o).map(|_| {
                if let Some(c) = count {
                    let inv = (1.0 / c.max(1) as f64) as f32;
                    o.mapv_inplace(|v| v * inv);
                }
            })
        }
        CpuArray::F64(x) => {
            let o = out_as::<f64>(op, out)?;
            reduce_into(x, &sorted, kind, o).map(|_| {
                if let Some(c) = count {
                    let inv = 1.0 / c.max(1) as f64;
                    o.mapv_inplace(|v| v * inv);
                }
            })
        }
        CpuArray::I64(x) if count.is_none() => reduce_into(x, &sorted, kind, out_as(op, out)?),
        x => return Err(float_input(op, x)),
    };
    done.ok_or_else(|| {
        kernel_err(
            op,
            format!(
                "cannot reduce {:?} over {dims:?} into {:?}",
                a.shape(),
                out.shape()
            ),
        )
    })
}

/// The dims of `a` summed away to reach `shape` (which broadcasts to `a`'s shape).
fn sum_to_dims(a: &[usize], shape: &[usize]) -> Option<Vec<usize>> {
    let lead = a.len().checked_sub(shape.len())?;
    Some(
        (0..a.len())
            .filter(|&d| d < lead || (shape[d - lead] == 1 && a[d] != 1))
            .collect(),
    )
}

impl ReductionKernels for CpuBackend {
    fn sum(
        &self,
        x: &CpuArray,
        dims: &[usize],
        _keepdim: bool,
        count: Option<usize>,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = if count.is_some() { "mean" } else { "sum" };
        reduce(op, x, dims, ReduceKind::Sum, count, out)
    }
    fn extremum(
        &self,
        which: Extremum,
        x: &CpuArray,
        dims: &[usize],
        out: &mut CpuArray,
    ) -> Result<()> {
        let kind = match which {
            Extremum::Max => ReduceKind::Max,
            Extremum::Min => ReduceKind::Min,
        };
        reduce(which.name(), x, dims, kind, None, out)
    }
    fn sum_to_shape(&self, x: &CpuArray, out: &mut CpuArray) -> Result<()> {
        let op = "sum_to_shape";
        let dims = sum_to_dims(x.shape(), out.shape()).ok_or_else(|| {
            kernel_err(
                op,
                format!("cannot sum {:?} to {:?}", x.shape(), out.shape()),
            )
        })?;
        reduce(op, x, &dims, ReduceKind::Sum, None, out)
    }
}
