//! Cross-entropy CUDA kernels: per-sample loss and logits gradient, one thread per row.

use super::super::kernels::{launch, per_row, Template};
use super::super::storage::CudaStorage;
use super::{float_only, last_dim_rows, CudaKernels};
use crate::op::{LossKernels, OutSpec};
use crate::Result;

impl LossKernels for CudaKernels {
    fn cross_entropy(
        &self,
        a: &CudaStorage,
        labels: &CudaStorage,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        let (rt, name) = (&self.rt, "cross_entropy");
        float_only(name, a.dtype)?;
        let (rows, c) = last_dim_rows(a);
        let y = self.alloc(out)?;
        let (r, cc, xp, lp, yp) = (rows as i64, c as i64, a.ptr(), labels.ptr(), y.ptr());
        if rows > 0 {
            launch!(rt, name, Template::CrossEntropy.at(a.dtype), per_row(rows); r, cc, xp, lp, yp)?;
        }
        Ok(y)
    }

    fn cross_entropy_backward(
        &self,
        a: &CudaStorage,
        labels: &CudaStorage,
        dy: &CudaStorage,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        let (rt, name) = (&self.rt, "cross_entropy_backward");
        float_only(name, a.dtype)?;
        let (rows, c) = last_dim_rows(a);
        let y = self.alloc(out)?;
        let (r, cc, xp, lp, gp, yp) = (
            rows as i64,
            c as i64,
            a.ptr(),
            labels.ptr(),
            dy.ptr(),
            y.ptr(),
        );
        if rows > 0 {
            launch!(rt, name, Template::CrossEntropyBw.at(a.dtype), per_row(rows); r, cc, xp, lp, gp, yp)?;
        }
        Ok(y)
    }
}
