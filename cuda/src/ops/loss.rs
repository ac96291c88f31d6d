//! Cross-entropy CUDA kernels, written into the executor's output piece: per-sample loss and
//! logits gradient, one block per row; and the vocabulary-parallel kernels on one class shard
//! (16-bit logits read as they are, computed in f32).

use super::super::derr;
use super::super::kernels::{grid, launch, per_row, Template};
use super::super::storage::CudaStorage;
use super::{fits, float_only, last_dim_rows, CudaKernels};
use oxiflow_tensor::backend::LossKernels;
use oxiflow_tensor::ClassShard;
use oxiflow_tensor::Result;

/// (rows, columns) of a class shard `[N, C]` (a shard of no columns keeps its rows), after
/// checking that the labels (if any) and every per-row piece have one value per row, the
/// pieces in the compute dtype.
fn shard_rows(
    name: &'static str,
    logits: &CudaStorage,
    labels: Option<&CudaStorage>,
    per_row: &[&CudaStorage],
) -> Result<(usize, usize)> {
    float_only(name, logits.dtype)?;
    let (rows, c) = match logits.shape.dims() {
        [n, c] => (*n, *c),
        _ => {
            return Err(derr(
                name,
                format!("logits {} are not [N, C]", logits.shape),
            ))
        }
    };
    if let Some(l) = labels.filter(|l| l.numel() != rows) {
        return Err(derr(
            name,
            format!("labels {} for logits {}", l.shape, logits.shape),
        ));
    }
    let compute = logits.dtype.compute();
    if let Some(bad) = per_row
        .iter()
        .find(|p| p.numel() != rows || p.dtype != compute)
    {
        return Err(derr(
            name,
            format!(
                "per-row piece {} {} for {} logits {} (needs {rows} values of {compute})",
                bad.dtype, bad.shape, logits.dtype, logits.shape
            ),
        ));
    }
    Ok((rows, c))
}

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

    fn vocab_parallel_lse(
        &self,
        a: &CudaStorage,
        at: ClassShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "vocab_parallel_log_sum_exp");
        let (rows, c) = shard_rows(name, a, None, &[out])?;
        if out.shape.dims().get(1) != Some(&1) {
            return Err(derr(
                name,
                format!(
                    "writes one column per class shard, got an output piece {}",
                    out.shape
                ),
            ));
        }
        let y = &*out;
        let (r, cc, st, cl) = (rows as i64, c as i64, at.start as i64, at.classes as i64);
        let (xp, yp) = (a.ptr(), y.ptr());
        if rows > 0 {
            launch!(rt, name, Template::VocabLse.at(a.dtype), per_row(rows); r, cc, st, cl, xp, yp)?;
        }
        Ok(())
    }

    fn vocab_parallel_loss(
        &self,
        a: &CudaStorage,
        labels: &CudaStorage,
        lse: &CudaStorage,
        at: ClassShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "vocab_parallel_cross_entropy");
        let (rows, c) = shard_rows(name, a, Some(labels), &[lse, out])?;
        let y = &*out;
        let (r, cc, st, cl) = (rows as i64, c as i64, at.start as i64, at.classes as i64);
        let (xp, lp, sp, yp) = (a.ptr(), labels.ptr(), lse.ptr(), y.ptr());
        if rows > 0 {
            launch!(rt, name, Template::VocabLoss.at(a.dtype), grid(rows); r, cc, st, cl, xp, lp, sp, yp)?;
        }
        Ok(())
    }

    fn vocab_parallel_backward(
        &self,
        a: &CudaStorage,
        labels: &CudaStorage,
        lse: &CudaStorage,
        dy: &CudaStorage,
        at: ClassShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "vocab_parallel_cross_entropy_backward");
        let (rows, c) = shard_rows(name, a, Some(labels), &[lse, dy])?;
        fits(name, a, out, true)?;
        let y = &*out;
        let (r, cc, st, cl) = (rows as i64, c as i64, at.start as i64, at.classes as i64);
        let (xp, lp, sp, gp, yp) = (a.ptr(), labels.ptr(), lse.ptr(), dy.ptr(), y.ptr());
        if rows > 0 && c > 0 {
            launch!(rt, name, Template::VocabBw.at(a.dtype), per_row(rows); r, cc, st, cl, xp, lp, sp, gp, yp)?;
        }
        Ok(())
    }
}
