//! Embedding CUDA kernels: row lookup and the scatter-add of its weight gradient.

use oxiflow_collectives::DType;

use super::super::copy::fill;
use super::super::derr;
use super::super::kernels::{grid, launch, sfx};
use super::super::storage::CudaStorage;
use super::{float_only, CudaKernels};
use crate::op::{EmbeddingKernels, OutSpec};
use crate::Result;

impl EmbeddingKernels for CudaKernels {
    fn embedding(&self, a: &CudaStorage, w: &CudaStorage, out: &OutSpec) -> Result<CudaStorage> {
        let (rt, name) = (&self.rt, "embedding");
        let wd = w.shape.dims();
        if a.dtype != DType::I64 || wd.len() != 2 {
            return Err(derr(name, "needs i64 ids and a 2-d float weight"));
        }
        float_only(name, w.dtype)?;
        let n = a.numel();
        let y = self.alloc(out)?;
        let (nn, h, v, ip, wp, yp) = (
            n as i64,
            wd[1] as i64,
            wd[0] as i64,
            a.ptr(),
            w.ptr(),
            y.ptr(),
        );
        if n * wd[1] > 0 {
            launch!(rt, name, format!("embedding_{}", sfx(w.dtype)), grid(n * wd[1]); nn, h, v, ip, wp, yp)?;
        }
        Ok(y)
    }

    fn embedding_backward(
        &self,
        a: &CudaStorage,
        g: &CudaStorage,
        num: usize,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        let (rt, name) = (&self.rt, "embedding_backward");
        float_only(name, g.dtype)?;
        let n = a.numel();
        let h = g.shape.dims().last().copied().unwrap_or(1);
        let y = self.alloc(out)?;
        fill(rt, name, g.dtype, y.ptr(), y.numel(), 0.0, 0)?;
        let (nn, hh, v, ip, gp, yp) = (n as i64, h as i64, num as i64, a.ptr(), g.ptr(), y.ptr());
        if n * h > 0 {
            launch!(rt, name, format!("embedding_bw_{}", sfx(g.dtype)), grid(n * h); nn, hh, v, ip, gp, yp)?;
        }
        Ok(y)
    }
}
