//! Cross-entropy CUDA kernels, written into the executor's output piece: per-sample loss and
//! logits gradient, one block per row.

use super::super::derr;
use super::super::kernels::{launch, per_row, Template};
use super::super::storage::CudaStorage;
use super::{fits, float_only, last_dim_rows, CudaKernels};
use crate::op::LossKernels;
use crate::Result;

impl LossKernels for CudaKernels {
    fn cross_entropy(
        &self,
        a: &CudaStorage,
        labels: &CudaStorage,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "cross_entropy");
        float_only(name, a.dtype)?;
        let (rows, c) = last_dim_rows(a);
        if labels.numel() != rows || out.numel() != rows || out.dtype != a.dtype {
            return Err(derr(
                name,
                format!(
                    "labels {} and output {} for logits {}",
                    labels.shape, out.shape, a.shape
                ),
            ));
        }
        let y = &*out;
        let (r, cc, xp, lp, yp) = (rows as i64, c as i64, a.ptr(), labels.ptr(), y.ptr());
        if rows > 0 {
            launch!(rt, name, Template::CrossEntropy.at(a.dtype), per_row(rows); r, cc, xp, lp, yp)?;
        }
        Ok(())
    }

    fn cross_entropy_backward(
        &self,
        a: &CudaStorage,
        labels: &CudaStorage,
        dy: &CudaStorage,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "cross_entropy_backward");
        float_only(name, a.dtype)?;
        fits(name, a, out, true)?;
        let (rows, c) = last_dim_rows(a);
        if labels.numel() != rows || dy.numel() != rows {
            return Err(derr(
                name,
                format!(
                    "labels {} and dy {} for logits {}",
                    labels.shape, dy.shape, a.shape
                ),
            ));
        }
        let y = &*out;
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
        Ok(())
    }
}
