//! Layout CPU kernels, written into the executor's row-major output buffer: permute (a strided
//! copy), copy (a reshape that copies), concat and narrow.

use ndarray::{ArrayD, Axis, IxDyn, Slice};

use super::{fits, out_as, CpuBackend};
use crate::element::TensorElement;
use crate::op::{kernel_err, LayoutKernels};
use crate::storage::CpuArray;
use crate::{with_array, Result};

fn permute_t<T: TensorElement>(a: &ArrayD<T>, perm: &[usize], out: &mut ArrayD<T>) -> Option<()> {
    if perm.len() != a.ndim() {
        return None;
    }
    let v = a.view().permuted_axes(IxDyn(perm));
    (v.shape() == out.shape()).then(|| out.assign(&v))
}

fn copy_t<T: TensorElement>(a: &ArrayD<T>, out: &mut ArrayD<T>) -> Option<()> {
    let a = a.as_standard_layout();
    let (src, dst) = (a.as_slice()?, out.as_slice_mut()?);
    (src.len() == dst.len()).then(|| dst.copy_from_slice(src))
}

fn concat_t<T: TensorElement>(parts: &[&CpuArray], dim: usize, out: &mut ArrayD<T>) -> Option<()> {
    if dim >= out.ndim() {
        return None;
    }
    let mut at: usize = 0;
    for p in parts {
        let p = T::view(p)?;
        let len = *p.shape().get(dim)?;
        let mut dst = out.slice_axis_mut(Axis(dim), Slice::from(at..at.checked_add(len)?));
        if dst.shape() != p.shape() {
            return None;
        }
        dst.assign(p);
        at += len;
    }
    (at == out.shape()[dim]).then_some(())
}

fn narrow_t<T: TensorElement>(
    a: &ArrayD<T>,
    dim: usize,
    start: usize,
    len: usize,
    out: &mut ArrayD<T>,
) -> Option<()> {
    let end = start.checked_add(len)?;
    if dim >= a.ndim() || end > a.shape()[dim] {
        return None;
    }
    let v = a.slice_axis(Axis(dim), Slice::from(start..end));
    (v.shape() == out.shape()).then(|| out.assign(&v))
}

impl LayoutKernels for CpuBackend {
    fn permute(&self, x: &CpuArray, perm: &[usize], out: &mut CpuArray) -> Result<()> {
        let op = "permute";
        let shape = out.shape().to_vec();
        with_array!(x, a => permute_t(a, perm, out_as(op, out)?)).ok_or_else(|| {
            kernel_err(
                op,
                format!("{:?} by {perm:?} does not give {shape:?}", x.shape()),
            )
        })
    }
    fn copy(&self, x: &CpuArray, out: &mut CpuArray) -> Result<()> {
        let op = "reshape";
        let shape = out.shape().to_vec();
        with_array!(x, a => copy_t(a, out_as(op, out)?)).ok_or_else(|| {
            kernel_err(
                op,
                format!("cannot reshape local piece {:?} to {shape:?}", x.shape()),
            )
        })
    }
    fn concat(&self, parts: &[&CpuArray], dim: usize, out: &mut CpuArray) -> Result<()> {
        let op = "concat";
        let shape = out.shape().to_vec();
        let done = with_array!(out, o => concat_t(parts, dim, o));
        done.ok_or_else(|| {
            kernel_err(
                op,
                format!(
                    "local pieces {:?} do not concatenate along dim {dim} into {shape:?}",
                    parts.iter().map(|p| p.shape().to_vec()).collect::<Vec<_>>()
                ),
            )
        })
    }
    fn narrow(
        &self,
        x: &CpuArray,
        dim: usize,
        start: usize,
        len: usize,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "narrow";
        fits(op, &[x.shape().len()], &[out.shape().len()])?;
        let shape = out.shape().to_vec();
        with_array!(x, a => narrow_t(a, dim, start, len, out_as(op, out)?)).ok_or_else(|| {
            kernel_err(
                op,
                format!(
                    "range {start}..{start}+{len} of dim {dim} of local piece {:?} does not give {shape:?}",
                    x.shape()
                ),
            )
        })
    }
}
