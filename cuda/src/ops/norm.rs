//! Layer-norm CUDA kernels, written into the executor's output pieces: forward (with each row's
//! mean and 1/std; on the fused one-pass kernel where it serves, else one block per row) and
//! the input gradient from those statistics over the last dim, one block per row.

use super::super::derr;
use super::super::kernels::{launch, per_row, Template};
use super::super::storage::CudaStorage;
use super::{fits, float_only, last_dim_rows, CudaKernels};
use oxiflow_tensor::backend::{norm_stats_dtype, NormKernels};
use oxiflow_tensor::Result;

/// A typed error unless each statistics piece holds one element per row, of the statistics
/// dtype of `x` (f32 for 16-bit data).
fn stats_fit(
    op: &'static str,
    rows: usize,
    x: &CudaStorage,
    stats: [&CudaStorage; 2],
) -> Result<()> {
    if stats
        .iter()
        .any(|s| s.numel() != rows || s.dtype != norm_stats_dtype(x.dtype))
    {
        return Err(derr(
            op,
            format!(
                "statistics {} and {} for the {rows} rows of {} {}",
                stats[0].shape, stats[1].shape, x.dtype, x.shape
            ),
        ));
    }
    Ok(())
}

impl NormKernels for CudaKernels {
    fn layer_norm_grads(
        &self,
        x: [&CudaStorage; 5],
        dr: Option<&CudaStorage>,
        out: [&mut CudaStorage; 3],
    ) -> Result<()> {
        super::residual_layer_norm::layer_norm_grads(self, x, dr, out)
    }

    fn layer_norm(
        &self,
        a: &CudaStorage,
        w: &CudaStorage,
        b: &CudaStorage,
        eps: f64,
        y: &mut CudaStorage,
        mean: &mut CudaStorage,
        rstd: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "layer_norm");
        float_only(name, a.dtype)?;
        fits(name, a, y, true)?;
        let (rows, h) = last_dim_rows(a);
        stats_fit(name, rows, a, [mean, rstd])?;
        if w.numel() != h || b.numel() != h {
            return Err(derr(
                name,
                format!("weight {} and bias {} for rows of {h}", w.shape, b.shape),
            ));
        }
        // The pieces are checked above; the fused kernel takes parameters of the data's dtype.
        let one_dtype = w.dtype == a.dtype && b.dtype == a.dtype;
        if one_dtype
            && super::residual_layer_norm::fused_forward(
                self,
                (rows, h),
                [a, w, b],
                None,
                eps,
                [&mut *y, &mut *mean, &mut *rstd],
            )?
        {
            return Ok(());
        }
        let (r, hh, e, xp, wp, bp, yp) = (
            rows as i64,
            h as i64,
            eps,
            a.ptr(),
            w.ptr(),
            b.ptr(),
            y.ptr(),
        );
        let (mp, rp) = (mean.ptr(), rstd.ptr());
        if rows > 0 {
            launch!(rt, name, Template::LayerNorm.at(a.dtype), per_row(rows); r, hh, e, xp, wp, bp, yp, mp, rp)?;
        }
        Ok(())
    }

    fn layer_norm_backward(
        &self,
        a: &CudaStorage,
        w: &CudaStorage,
        dy: &CudaStorage,
        mean: &CudaStorage,
        rstd: &CudaStorage,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let (rt, name) = (&self.rt, "layer_norm_backward");
        float_only(name, a.dtype)?;
        fits(name, a, out, true)?;
        fits(name, dy, out, true)?;
        let (rows, h) = last_dim_rows(a);
        stats_fit(name, rows, a, [mean, rstd])?;
        if w.numel() != h {
            return Err(derr(name, format!("weight {} for rows of {h}", w.shape)));
        }
        let (r, hh, xp, wp, gp, yp) =
            (rows as i64, h as i64, a.ptr(), w.ptr(), dy.ptr(), out.ptr());
        let (mp, rp) = (mean.ptr(), rstd.ptr());
        if rows > 0 {
            launch!(rt, name, Template::LayerNormBw.at(a.dtype), per_row(rows); r, hh, xp, wp, gp, mp, rp, yp)?;
        }
        Ok(())
    }
}
