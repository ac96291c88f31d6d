//! Fused residual LayerNorm CUDA kernels: the raw layer's one-pass forward (sum, norm and
//! statistics; public, for the ops crate's residual LayerNorm; without the residual, the plain
//! LayerNorm's forward where it serves) and the layer norm's whole
//! backward (the residual gradient added, weight and bias gradients reduced in a fixed order;
//! `NormKernels::layer_norm_grads`); f64 data, rows too wide for the fused kernels and empty
//! pieces take the composed kernels.

use crate::copy::fill;
use crate::derr;
use crate::fused::{layer_norm_backward, layer_norm_forward};
use crate::fused::{LayerNormBackward, LayerNormForward};
use crate::ops::{last_dim_rows, CudaKernels};
use crate::raw::{FResult, FloatType};
use crate::storage::CudaStorage;
use oxiflow_tensor::backend::{composed_layer_norm_grads, norm_stats_dtype};
use oxiflow_tensor::Result;

/// A typed error unless the pieces fit rows of `cols` values: the data pieces (`data`) hold
/// `rows * cols` elements of the first one's dtype, `params` `cols` of it, `stats` one per row
/// of the statistics dtype.
fn check(
    op: &'static str,
    data: &[&CudaStorage],
    params: &[&CudaStorage],
    stats: &[&CudaStorage],
) -> Result<(usize, usize)> {
    let first = data[0];
    let (rows, cols) = last_dim_rows(first);
    let dt = first.dtype;
    let bad = data
        .iter()
        .any(|p| p.numel() != first.numel() || p.dtype != dt)
        || params.iter().any(|p| p.numel() != cols || p.dtype != dt)
        || stats
            .iter()
            .any(|p| p.numel() != rows || p.dtype != norm_stats_dtype(dt));
    if bad {
        let show = |v: &[&CudaStorage]| {
            v.iter()
                .map(|p| format!("{} {}", p.dtype, p.shape))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(derr(
            op,
            format!(
                "pieces [{}], parameters [{}] and statistics [{}] do not fit rows of {cols}",
                show(data),
                show(params),
                show(stats)
            ),
        ));
    }
    Ok((rows, cols))
}

/// `Ok(true)` when the fused kernel ran, `Ok(false)` when it does not serve the call (the
/// caller composes), else its error.
fn ran(r: FResult<()>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(e) if e.is_fallback() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The fused residual add + LayerNorm forward over the last dim, x = [x, a, weight, bias] into
/// out = [x + a, LayerNorm(x + a), mean, rstd] in one pass: `Ok(true)` when it ran (or there
/// are no rows), `Ok(false)` when it does not serve the call (f64 data, rows too wide, no
/// columns), and the caller composes the add and LayerNorm kernels.
pub fn residual_layer_norm_forward(
    k: &CudaKernels,
    x: [&CudaStorage; 4],
    eps: f64,
    out: [&mut CudaStorage; 4],
) -> Result<bool> {
    let [xs, a, w, bias] = x;
    let [r, y, mean, rstd] = out;
    let (rows, cols) = check(
        "residual_layer_norm",
        &[xs, a, r, y],
        &[w, bias],
        &[mean, rstd],
    )?;
    fused_forward(
        k,
        (rows, cols),
        [xs, w, bias],
        Some((a, r)),
        eps,
        [y, mean, rstd],
    )
}

/// The fused forward of checked pieces (`rows` x `cols` of one dtype): `[x, weight, bias]`,
/// with `(a, x + a)` when a residual is added, into `[y, mean, rstd]`; `Ok(true)` when it ran
/// (or there are no rows), `Ok(false)` when it does not serve the call (f64 data, rows too
/// wide, no columns) and the caller runs other kernels.
pub(super) fn fused_forward(
    k: &CudaKernels,
    (rows, cols): (usize, usize),
    [xs, w, bias]: [&CudaStorage; 3],
    residual: Option<(&CudaStorage, &mut CudaStorage)>,
    eps: f64,
    [y, mean, rstd]: [&mut CudaStorage; 3],
) -> Result<bool> {
    if rows == 0 {
        return Ok(true);
    }
    let (Some(dtype), true) = (FloatType::of(xs.dtype), cols > 0) else {
        return Ok(false);
    };
    let args = LayerNormForward {
        rows,
        cols,
        eps: eps as f32,
        dtype,
        x: xs.ptr(),
        residual: residual.as_ref().map(|(a, _)| a.ptr()),
        weight: w.ptr(),
        bias: bias.ptr(),
        sum_out: residual.as_ref().map(|(_, r)| r.ptr()),
        y: y.ptr(),
        mean: mean.ptr(),
        rstd: rstd.ptr(),
    };
    ran(layer_norm_forward(&k.rt, &args))
}

/// `NormKernels::layer_norm_grads` on CUDA: the fused one-pass backward where it serves the
/// call, else the composed kernels.
pub(super) fn layer_norm_grads(
    k: &CudaKernels,
    x: [&CudaStorage; 5],
    dr: Option<&CudaStorage>,
    out: [&mut CudaStorage; 3],
) -> Result<()> {
    let op = "residual_layer_norm_backward";
    let [r, w, mean, rstd, dy] = x;
    let [dx, dw, db] = out;
    let mut data = vec![r, dy, &*dx];
    data.extend(dr);
    let (rows, cols) = check(op, &data, &[w, dw, db], &[mean, rstd])?;
    if rows == 0 {
        // No rows: the parameter gradients are zero sums.
        for p in [&*dw, &*db] {
            fill(&k.rt, op, p.dtype, p.ptr(), p.numel(), 0.0, 0)?;
        }
        return Ok(());
    }
    if let (Some(dtype), true) = (FloatType::of(r.dtype), cols > 0) {
        let args = LayerNormBackward {
            rows,
            cols,
            dtype,
            dy: dy.ptr(),
            r: r.ptr(),
            mean: mean.ptr(),
            rstd: rstd.ptr(),
            weight: w.ptr(),
            residual_grad: dr.map(CudaStorage::ptr),
            dr: dx.ptr(),
            dweight: dw.ptr(),
            dbias: db.ptr(),
            grad_type: dtype,
            accumulate: false,
        };
        if ran(layer_norm_backward(&k.rt, &args))? {
            return Ok(());
        }
    }
    composed_layer_norm_grads(k, x, dr, [dx, dw, db])
}
