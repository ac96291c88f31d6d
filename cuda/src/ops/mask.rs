//! Mask CUDA kernels, written into the executor's output piece: where and masked fill (operands broadcast to the output first, the
//! condition cast to f64), and the triangular masks at a global row/column offset.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use super::super::copy::fill;
use super::super::kernels::{grid, launch, Template};
use super::super::storage::CudaStorage;
use super::{fits, CudaKernels};
use oxiflow_tensor::backend::{ElementwiseKernels, MaskKernels};
use oxiflow_tensor::Result;
use oxiflow_tensor::{BinaryOp, KernelBackend, OutSpec, Triangle};

impl CudaKernels {
    /// `x` broadcast to `shape` as a contiguous scratch piece (plus a zero piece of that shape).
    fn expanded(&self, x: &CudaStorage, shape: &Shape) -> Result<CudaStorage> {
        if &x.shape == shape {
            return Ok(x.clone());
        }
        let spec = OutSpec {
            shape: shape.clone(),
            dtype: x.dtype,
        };
        let zero = self.filled(&spec, 0.0)?;
        let mut y = self.alloc(&spec)?;
        self.binary(BinaryOp::Add, x, &zero, &mut y)?;
        Ok(y)
    }

    /// A scratch piece of `spec` filled with `v`.
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
        out: &mut CudaStorage,
    ) -> Result<()> {
        let name = "where";
        let as_f64 = OutSpec {
            shape: cond.shape.clone(),
            dtype: DType::F64,
        };
        let mut cf = self.alloc(&as_f64)?;
        self.cast(cond, &mut cf)?;
        let c = self.expanded(&cf, &out.shape)?;
        let (a, b) = (self.expanded(a, &out.shape)?, self.expanded(b, &out.shape)?);
        if a.dtype != out.dtype || b.dtype != out.dtype {
            return Err(super::super::derr(name, "values of different dtypes"));
        }
        let y = &*out;
        let n = y.numel();
        if n > 0 {
            let (nn, cp, ap, bp, yp) = (n as i64, c.ptr(), a.ptr(), b.ptr(), y.ptr());
            launch!(self.rt, name, Template::Where.at(out.dtype), grid(n); nn, cp, ap, bp, yp)?;
        }
        Ok(())
    }

    fn masked_fill(
        &self,
        x: &CudaStorage,
        mask: &CudaStorage,
        value: f64,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let v = self.filled(&self.out_spec(out), value)?;
        self.where_cond(mask, &v, x, out)
    }

    fn triangular(
        &self,
        x: &CudaStorage,
        keep: Triangle,
        k: i64,
        row0: usize,
        col0: usize,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let name = "triangular";
        let d = x.shape.dims();
        let (rows, cols) = match d {
            [.., r, c] => (*r, *c),
            _ => return Err(super::super::derr(name, "needs at least 2 dims")),
        };
        fits(name, x, out, true)?;
        let y = &*out;
        let n = y.numel();
        if n > 0 {
            let (nn, r, c, r0, c0) = (n as i64, rows as i64, cols as i64, row0 as i64, col0 as i64);
            let (up, xp, yp) = (i32::from(keep == Triangle::Upper), x.ptr(), y.ptr());
            launch!(self.rt, name, Template::Triangular.at(x.dtype), grid(n); nn, r, c, r0, c0, k, up, xp, yp)?;
        }
        Ok(())
    }
}
