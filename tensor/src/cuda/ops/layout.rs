//! Layout CUDA kernels: permute, reshape (a view of the same block), concat and narrow through
//! strided copies.

use std::sync::Arc;

use oxiflow_sbp::Shape;

use super::super::copy::copy_nd;
use super::super::kernels::strides;
use super::super::storage::CudaStorage;
use super::super::{derr, CudaRuntime};
use super::CudaKernels;
use crate::op::{LayoutKernels, OutSpec};
use crate::Result;

/// `x` with its dims permuted (output dim i is input dim `perm[i]`), contiguous.
pub(crate) fn permute(
    rt: &Arc<CudaRuntime>,
    x: &CudaStorage,
    perm: &[usize],
) -> Result<CudaStorage> {
    let d = x.shape.dims();
    let st = strides(d);
    let out_dims: Vec<usize> = perm.iter().map(|&p| d[p]).collect();
    let src_st: Vec<i64> = perm.iter().map(|&p| st[p]).collect();
    let out = CudaStorage::alloc(rt, x.dtype, Shape::from(out_dims.as_slice()))?;
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
    )?;
    Ok(out)
}

impl LayoutKernels for CudaKernels {
    fn permute(&self, x: &CudaStorage, perm: &[usize], _out: &OutSpec) -> Result<CudaStorage> {
        permute(&self.rt, x, perm)
    }

    fn reshape(&self, a: &CudaStorage, out: &OutSpec) -> Result<CudaStorage> {
        if out.shape.numel() != a.numel() {
            return Err(derr(
                "reshape",
                format!("cannot reshape local piece {} to {}", a.shape, out.shape),
            ));
        }
        Ok(a.reshaped(out.shape.clone()))
    }

    fn concat(&self, x: &[&CudaStorage], dim: usize, out: &OutSpec) -> Result<CudaStorage> {
        let name = "concat";
        let dt = out.dtype;
        let y = self.alloc(out)?;
        let od = out.shape.dims();
        let ost = strides(od);
        let mut at = 0usize;
        for p in x {
            let pd = p.shape.dims();
            if p.dtype != dt || pd.len() != od.len() {
                return Err(derr(
                    name,
                    format!("local pieces do not concatenate along dim {dim}"),
                ));
            }
            copy_nd(
                &self.rt,
                name,
                dt,
                pd,
                p.ptr(),
                0,
                &strides(pd),
                y.ptr(),
                at * ost[dim] as usize,
                &ost,
                0,
            )?;
            at += pd[dim];
        }
        Ok(y)
    }

    fn narrow(
        &self,
        a: &CudaStorage,
        dim: usize,
        start: usize,
        len: usize,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
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
        let y = self.alloc(out)?;
        copy_nd(
            &self.rt,
            name,
            a.dtype,
            &bx,
            a.ptr(),
            start * st[dim] as usize,
            &st,
            y.ptr(),
            0,
            &strides(&bx),
            0,
        )?;
        Ok(y)
    }
}
