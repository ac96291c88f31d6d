//! Mask CUDA kernels: where and masked fill (operands broadcast to the output first, the
//! condition cast to f64), and the triangular masks at a global row/column offset.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use super::super::copy::fill;
use super::super::kernels::{grid, launch, Template};
use super::super::storage::CudaStorage;
use super::CudaKernels;
use crate::op::{BinaryOp, ElementwiseKernels, MaskKernels, OutSpec, Triangle};
use crate::Result;

impl CudaKernels {
    /// `x` broadcast to `shape` as a contiguous piece (plus a zero piece of that shape).
    fn expanded(&self, x: &CudaStorage, shape: &Shape) -> Result<CudaStorage> {
        if &x.shape == shape {
            return Ok(x.clone());
        }
        let spec = OutSpec {
            shape: shape.clone(),
            dtype: x.dtype,
        };
        let zero = self.filled(&spec, 0.0)?;
        self.binary(BinaryOp::Add, x, &zero, &spec)
    }

    /// A piece of `spec` filled with `v`.
    fn filled(&self, spec: &OutSpec, v: f64) -> Result<CudaStorage> {
        let y = self.alloc(spec)?;
        fill(
            &self.rt,
            "fill",
            spec.dtype,
            y.ptr(),
            y.numel(),
            v,
            v as i64,
        )?;
        Ok(y)
    }
}

impl MaskKernels for CudaKernels {
    fn where_cond(
        &self,
        cond: &CudaStorage,
        a: &CudaStorage,
        b: &CudaStorage,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        let name = "where";
        let as_f64 = OutSpec {
            shape: cond.shape.clone(),
            dtype: DType::F64,
        };
        let c = self.expanded(&self.cast(cond, &as_f64)?, &out.shape)?;
        let (a, b) = (self.expanded(a, &out.shape)?, self.expanded(b, &out.shape)?);
        let y = self.alloc(out)?;
        let n = y.numel();
        if n > 0 {
            let (nn, cp, ap, bp, yp) = (n as i64, c.ptr(), a.ptr(), b.ptr(), y.ptr());
            launch!(self.rt, name, Template::Where.at(out.dtype), grid(n); nn, cp, ap, bp, yp)?;
        }
        Ok(y)
    }

    fn masked_fill(
        &self,
        x: &CudaStorage,
        mask: &CudaStorage,
        value: f64,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        let v = self.filled(out, value)?;
        self.where_cond(mask, &v, x, out)
    }

    fn triangular(
        &self,
        x: &CudaStorage,
        keep: Triangle,
        k: i64,
        row0: usize,
        col0: usize,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        let name = "triangular";
        let d = x.shape.dims();
        let (rows, cols) = match d {
            [.., r, c] => (*r, *c),
            _ => return Err(super::super::derr(name, "needs at least 2 dims")),
        };
        let y = self.alloc(out)?;
        let n = y.numel();
        if n > 0 {
            let (nn, r, c, r0, c0) = (n as i64, rows as i64, cols as i64, row0 as i64, col0 as i64);
            let (up, xp, yp) = (i32::from(keep == Triangle::Upper), x.ptr(), y.ptr());
            launch!(self.rt, name, Template::Triangular.at(x.dtype), grid(n); nn, r, c, r0, c0, k, up, xp, yp)?;
        }
        Ok(y)
    }
}
