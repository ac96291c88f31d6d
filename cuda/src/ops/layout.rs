//! Layout CUDA kernels, written into the executor's output piece: permute, copy, concat and
//! narrow through strided copies, a concatenation along the leading dim in one multi-range
//! copy (a reshape is a view of the same block, `reshaped`).

use std::sync::Arc;

use oxiflow_sbp::Shape;

use super::super::copy::copy_nd;
use super::super::copy_many::{copy_many, CopyEntry};
use super::super::kernels::strides;
use super::super::storage::CudaStorage;
use super::super::{derr, CudaRuntime};
use super::CudaKernels;
use oxiflow_tensor::backend::LayoutKernels;
use oxiflow_tensor::Result;

/// `x` with its dims permuted (output dim i is input dim `perm[i]`) into `out`.
fn permute_into(
    rt: &Arc<CudaRuntime>,
    x: &CudaStorage,
    perm: &[usize],
    out: &CudaStorage,
) -> Result<()> {
    let d = x.shape.dims();
    let st = strides(d);
    if perm.len() != d.len() || perm.iter().any(|&p| p >= d.len()) {
        return Err(derr(
            "permute",
            format!("{perm:?} does not permute {}", x.shape),
        ));
    }
    let out_dims: Vec<usize> = perm.iter().map(|&p| d[p]).collect();
    if out.shape.dims() != out_dims.as_slice() || out.dtype != x.dtype {
        return Err(derr(
            "permute",
            format!(
                "{} by {perm:?} does not give {} {}",
                x.shape, out.dtype, out.shape
            ),
        ));
    }
    let src_st: Vec<i64> = perm.iter().map(|&p| st[p]).collect();
    copy_nd(
        rt,
        "permute",
        x.dtype,
        &out_dims,
        x.ptr(),
        0,
        &src_st,
        out.ptr(),
        0,
        &strides(&out_dims),
        0,
    )
}

/// `x` with its dims permuted into a new piece (a scratch piece for other kernels).
pub(crate) fn permute(
    rt: &Arc<CudaRuntime>,
    x: &CudaStorage,
    perm: &[usize],
) -> Result<CudaStorage> {
    let d = x.shape.dims();
    let out_dims: Vec<usize> = perm.iter().filter_map(|&p| d.get(p).copied()).collect();
    let out = CudaStorage::alloc(rt, x.dtype, Shape::from(out_dims.as_slice()))?;
    permute_into(rt, x, perm, &out)?;
    Ok(out)
}

/// `x`'s elements, in order, into `out` (same count and dtype).
pub(super) fn copy_into(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    x: &CudaStorage,
    out: &CudaStorage,
) -> Result<()> {
    super::fits_as(op, x, out, true, ("cannot copy", "into"))?;
    let n = x.numel();
    copy_nd(
        rt,
        op,
        x.dtype,
        &[n],
        x.ptr(),
        0,
        &[1],
        out.ptr(),
        0,
        &[1],
        0,
    )
}

impl LayoutKernels for CudaKernels {
    fn permute(&self, x: &CudaStorage, perm: &[usize], out: &mut CudaStorage) -> Result<()> {
        permute_into(&self.rt, x, perm, out)
    }

    fn copy(&self, a: &CudaStorage, out: &mut CudaStorage) -> Result<()> {
        copy_into(&self.rt, "reshape", a, out)
    }

    fn concat(&self, x: &[&CudaStorage], dim: usize, out: &mut CudaStorage) -> Result<()> {
        let name = "concat";
        let dt = out.dtype;
        let y = &*out;
        let od = out.shape.dims();
        let ost = strides(od);
        let mut at = 0usize;
        // Along the leading dim (every dim before `dim` of size 1) each piece is one contiguous
        // range of the output: all of them in one multi-range copy.
        let ranges = od[..dim.min(od.len())].iter().all(|&n| n == 1)
            && x.len() > 1
            && x.iter()
                .all(|p| p.dtype == dt && p.shape.ndim() == od.len());
        let mut list = Vec::with_capacity(if ranges { x.len() } else { 0 });
        for p in x {
            let pd = p.shape.dims();
            let fits = p.dtype == dt
                && pd.len() == od.len()
                && dim < od.len()
                && (0..od.len()).all(|i| i == dim || pd[i] == od[i])
                && at + pd[dim] <= od[dim];
            if !fits {
                return Err(derr(
                    name,
                    format!(
                        "local pieces do not concatenate along dim {dim} into {}",
                        out.shape
                    ),
                ));
            }
            let off = at * ost[dim] as usize;
            if ranges {
                let esz = dt.size();
                list.push(CopyEntry::new(
                    p.ptr(),
                    y.ptr() + (off * esz) as u64,
                    p.numel() * esz,
                ));
            } else {
                copy_nd(
                    &self.rt,
                    name,
                    dt,
                    pd,
                    p.ptr(),
                    0,
                    &strides(pd),
                    y.ptr(),
                    off,
                    &ost,
                    0,
                )?;
            }
            at += pd[dim];
        }
        if ranges {
            copy_many(&self.rt, &list).map_err(|e| derr(name, e))?;
        }
        Ok(())
    }

    fn narrow(
        &self,
        a: &CudaStorage,
        dim: usize,
        start: usize,
        len: usize,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let name = "narrow";
        let d = a.shape.dims();
        if dim >= d.len() || start + len > d[dim] {
            return Err(derr(
                name,
                format!(
                    "range {start}..{} out of local piece {} dim {dim}",
                    start + len,
                    a.shape
                ),
            ));
        }
        let st = strides(d);
        let mut bx = d.to_vec();
        bx[dim] = len;
        if out.shape.dims() != bx.as_slice() || out.dtype != a.dtype {
            return Err(derr(
                name,
                format!(
                    "output {} {} for a narrow of {}",
                    out.dtype, out.shape, a.shape
                ),
            ));
        }
        copy_nd(
            &self.rt,
            name,
            a.dtype,
            &bx,
            a.ptr(),
            start * st[dim] as usize,
            &st,
            out.ptr(),
            0,
            &strides(&bx),
            0,
        )
    }
}
