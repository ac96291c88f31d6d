//! Layer-norm CUDA kernels: forward and input gradient over the last dim, one thread per row.

use super::super::kernels::{launch, per_row, Template};
use super::super::storage::CudaStorage;
use super::{float_only, last_dim_rows, CudaKernels};
use crate::op::{NormKernels, OutSpec};
use crate::Result;

impl NormKernels for CudaKernels {
    fn layer_norm(
        &self,
        a: &CudaStorage,
        w: &CudaStorage,
        b: &CudaStorage,
        eps: f64,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        let (rt, name) = (&self.rt, "layer_norm");
        float_only(name, a.dtype)?;
        let (rows, h) = last_dim_rows(a);
        let y = self.alloc(out)?;
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
            launch!(rt, name, Template::LayerNorm.at(a.dtype), per_row(rows); r, hh, e, xp, wp, bp, yp)?;
        }
        Ok(y)
    }

    fn layer_norm_backward(
        &self,
        a: &CudaStorage,
        w: &CudaStorage,
        dy: &CudaStorage,
        eps: f64,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        let (rt, name) = (&self.rt, "layer_norm_backward");
        float_only(name, a.dtype)?;
        let (rows, h) = last_dim_rows(a);
        let y = self.alloc(out)?;
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
            launch!(rt, name, Template::LayerNormBw.at(a.dtype), per_row(rows); r, hh, e, xp, wp, gp, yp)?;
        }
        Ok(y)
    }
}
