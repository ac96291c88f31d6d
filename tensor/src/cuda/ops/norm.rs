//! Layer-norm CUDA kernels, written into the executor's output piece: forward and input
//! gradient over the last dim, one block per row.

use super::super::kernels::{launch, per_row, sfx};
use super::super::storage::CudaStorage;
use super::{fits, float_only, last_dim_rows, CudaKernels};
use crate::op::NormKernels;
use crate::Result;

impl NormKernels for CudaKernels {
    fn layer_norm(
        &self,
        a: &CudaStorage,
        w: &CudaStorage,
        b: &CudaStorage,
        eps: f64,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "layer_norm");
        float_only(name, a.dtype)?;
        fits(name, a, out, true)?;
        let (rows, h) = last_dim_rows(a);
        let y = &*out;
        let (r, hh, e, xp, wp, bp, yp) = (
            rows as i64,
            h as i64,
            eps,
            a.ptr(),
            w.ptr(),
            b.ptr(),
            y.ptr(),
        );
        if rows > 0 {
            launch!(rt, name, format!("layer_norm_{}", sfx(a.dtype)), per_row(rows); r, hh, e, xp, wp, bp, yp)?;
        }
        Ok(())
    }

    fn layer_norm_backward(
        &self,
        a: &CudaStorage,
        w: &CudaStorage,
        dy: &CudaStorage,
        eps: f64,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "layer_norm_backward");
        float_only(name, a.dtype)?;
        fits(name, a, out, true)?;
        fits(name, dy, out, true)?;
        let (rows, h) = last_dim_rows(a);
        let y = &*out;
        let (r, hh, e, xp, wp, gp, yp) = (
            rows as i64,
            h as i64,
            eps,
            a.ptr(),
            w.ptr(),
            dy.ptr(),
            y.ptr(),
        );
        if rows > 0 {
            launch!(rt, name, format!("layer_norm_bw_{}", sfx(a.dtype)), per_row(rows); r, hh, e, xp, wp, gp, yp)?;
        }
        Ok(())
    }
}
