//! Reduction CPU kernels: sum/mean/max/min over dims and sum-to-shape (the reverse of
//! broadcasting).

use ndarray::{ArrayD, Axis, IxDyn};

use super::float_input;
use super::{checked, CpuBackend};
use crate::element::TensorElement;
use crate::op::{OutSpec, ReductionKernels};
use crate::storage::CpuArray;
use crate::with_array;
use crate::{Result, TensorError};
use oxiflow_sbp::ReduceKind;

fn reduce_dims<T: TensorElement>(
    a: &ArrayD<T>,
    dims: &[usize],
    keepdim: bool,
    kind: ReduceKind,
) -> ArrayD<T> {
    let mut sorted: Vec<usize> = dims.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = a.clone();
    for &d in sorted.iter().rev() {
        out = match kind {
            ReduceKind::Max => out.fold_axis(
                Axis(d),
                T::lowest(),
                |&acc, &x| if x > acc { x } else { acc },
            ),
            ReduceKind::Min => out.fold_axis(
                Axis(d),
                T::highest(),
                |&acc, &x| if x < acc { x } else { acc },
            ),
            ReduceKind::Sum | ReduceKind::Mean => out.sum_axis(Axis(d)),
        };
        if keepdim {
            out = out.insert_axis(Axis(d));
        }
    }
    out
}

/// Sum, max or min over `dims` (a mean here is the sum).
pub fn reduce(a: &CpuArray, dims: &[usize], keepdim: bool, kind: ReduceKind) -> CpuArray {
    with_array!(a, a => TensorElement::wrap(reduce_dims(a, dims, keepdim, kind)))
}

/// Sum over `dims` times 1 / `count` (`count` = 0: the number of reduced elements of `a`).
pub fn mean(a: &CpuArray, dims: &[usize], keepdim: bool, count: usize) -> Result<CpuArray> {
    let count = if count == 0 {
        dims.iter().map(|&d| a.shape()[d]).product::<usize>()
    } else {
        count
    };
    let inv = 1.0 / count as f64;
    Ok(match reduce(a, dims, keepdim, ReduceKind::Sum) {
        CpuArray::F32(s) => CpuArray::F32(s * inv as f32),
        CpuArray::F64(s) => CpuArray::F64(s * inv),
        x => return Err(float_input("mean", &x)),
    })
}

/// Sums `a` down to `shape` (which broadcasts to `a`'s shape).
pub fn sum_to_shape(a: &CpuArray, shape: &[usize]) -> Result<CpuArray> {
    let s = a.shape();
    let lead = s.len() - shape.len();
    let dims: Vec<usize> = (0..s.len())
        .filter(|&d| d < lead || (shape[d - lead] == 1 && s[d] != 1))
        .collect();
    let r = reduce(a, &dims, true, ReduceKind::Sum);
    fn reshape<T: TensorElement>(a: ArrayD<T>, shape: &[usize]) -> Option<ArrayD<T>> {
        a.into_shape_with_order(IxDyn(shape)).ok()
    }
    let out = with_array!(r, a => reshape(a, shape).map(TensorElement::wrap));
    out.ok_or_else(|| TensorError::Kernel {
        op: "sum_to_shape",
        detail: format!("cannot sum {s:?} to {shape:?}"),
    })
}

impl ReductionKernels for CpuBackend {
    fn sum(
        &self,
        x: &CpuArray,
        dims: &[usize],
        keepdim: bool,
        count: Option<usize>,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        match count {
            Some(count) => checked("mean", mean(x, dims, keepdim, count)?, out),
            None => checked("sum", reduce(x, dims, keepdim, ReduceKind::Sum), out),
        }
    }
    fn max(&self, x: &CpuArray, dims: &[usize], keepdim: bool, out: &OutSpec) -> Result<CpuArray> {
        checked("max", reduce(x, dims, keepdim, ReduceKind::Max), out)
    }
    fn min(&self, x: &CpuArray, dims: &[usize], keepdim: bool, out: &OutSpec) -> Result<CpuArray> {
        checked("min", reduce(x, dims, keepdim, ReduceKind::Min), out)
    }
    fn sum_to_shape(&self, x: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked("sum_to_shape", sum_to_shape(x, out.shape.dims())?, out)
    }
}
