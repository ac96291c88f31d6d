//! Normalization CPU kernels: layer norm over the last dim and its input gradient.

use ndarray::{ArrayD, Axis, Zip};

use super::elementwise::PAR_THRESHOLD;
use super::float_input;
use super::{checked, rows, CpuBackend};
use crate::element::FloatElement;
use crate::op::kernel_err;
use crate::op::{NormKernels, OutSpec};
use crate::storage::CpuArray;
use crate::Result;

/// Mean and 1/std of one row.
fn moments<F: FloatElement>(x: ndarray::ArrayView1<F>, eps: F) -> (F, F) {
    let n = F::from_f64(x.len().max(1) as f64);
    let mean = x.sum() / n;
    let mut var = F::from_f64(0.0);
    x.iter().for_each(|&v| var += (v - mean) * (v - mean));
    (mean, (var / n + eps).sqrt().recip())
}

fn layer_norm_t<F: FloatElement>(
    x: &ArrayD<F>,
    w: Option<&ArrayD<F>>,
    b: Option<&ArrayD<F>>,
    eps: f64,
) -> Result<ArrayD<F>> {
    let eps = F::from_f64(eps);
    let mut out = x.to_owned();
    let h = *x
        .shape()
        .last()
        .ok_or_else(|| kernel_err("layer_norm", "needs a dim".into()))?;
    let n: usize = x.shape()[..x.ndim() - 1].iter().product();
    let mut o2 = out
        .view_mut()
        .into_shape_with_order((n, h))
        .map_err(|e| kernel_err("layer_norm", e.to_string()))?;
    let w = w.map(|a| a.view());
    let b = b.map(|a| a.view());
    let f = |mut row: ndarray::ArrayViewMut1<F>| {
        let (mean, rstd) = moments(row.view(), eps);
        for (j, v) in row.iter_mut().enumerate() {
            let mut y = (*v - mean) * rstd;
            if let Some(w) = &w {
                y *= w[[j]];
            }
            if let Some(b) = &b {
                y += b[[j]];
            }
            *v = y;
        }
    };
    let z = Zip::from(o2.axis_iter_mut(Axis(0)));
    if n * h >= PAR_THRESHOLD {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
    Ok(out)
}

/// Layer norm over the last dim, with optional weight and bias [H].
pub fn layer_norm(
    x: &CpuArray,
    w: Option<&CpuArray>,
    b: Option<&CpuArray>,
    eps: f64,
) -> Result<CpuArray> {
    match x {
        CpuArray::F32(x) => Ok(CpuArray::F32(layer_norm_t(
            x,
            w.and_then(|a| a.as_array()),
            b.and_then(|a| a.as_array()),
            eps,
        )?)),
        CpuArray::F64(x) => Ok(CpuArray::F64(layer_norm_t(
            x,
            w.and_then(|a| a.as_array()),
            b.and_then(|a| a.as_array()),
            eps,
        )?)),
        x => Err(float_input("layer_norm", x)),
    }
}

fn layer_norm_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    x: &ArrayD<F>,
    w: Option<&ArrayD<F>>,
    eps: f64,
) -> Result<ArrayD<F>> {
    let eps = F::from_f64(eps);
    let xr = rows(x).ok_or_else(|| kernel_err("layer_norm_backward", "needs a dim".into()))?;
    let h = xr.ncols();
    let hf = F::from_f64(h.max(1) as f64);
    let mut out = dy.to_owned();
    let mut o2 = out
        .view_mut()
        .into_shape_with_order((xr.nrows(), h))
        .map_err(|e| kernel_err("layer_norm_backward", e.to_string()))?;
    let w = w.map(|a| a.view());
    let f = |mut g: ndarray::ArrayViewMut1<F>, x: ndarray::ArrayView1<F>| {
        let (mean, rstd) = moments(x, eps);
        if let Some(w) = &w {
            for (j, v) in g.iter_mut().enumerate() {
                *v *= w[[j]];
            }
        }
        let (mut sg, mut sgx) = (F::from_f64(0.0), F::from_f64(0.0));
        for (&gv, &xv) in g.iter().zip(x.iter()) {
            sg += gv;
            sgx += gv * (xv - mean) * rstd;
        }
        let (mg, mgx) = (sg / hf, sgx / hf);
        for (gv, &xv) in g.iter_mut().zip(x.iter()) {
            let xh = (xv - mean) * rstd;
            *gv = rstd * (*gv - mg - xh * mgx);
        }
    };
    let z = Zip::from(o2.axis_iter_mut(Axis(0))).and(xr.axis_iter(Axis(0)));
    if xr.len() >= PAR_THRESHOLD {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
    Ok(out)
}

/// dx of layer norm over the last dim (weight optional).
pub fn layer_norm_backward(
    dy: &CpuArray,
    x: &CpuArray,
    w: Option<&CpuArray>,
    eps: f64,
) -> Result<CpuArray> {
    match (dy, x) {
        (CpuArray::F32(g), CpuArray::F32(x)) => Ok(CpuArray::F32(layer_norm_backward_t(
            g,
            x,
            w.and_then(|a| a.as_array()),
            eps,
        )?)),
        (CpuArray::F64(g), CpuArray::F64(x)) => Ok(CpuArray::F64(layer_norm_backward_t(
            g,
            x,
            w.and_then(|a| a.as_array()),
            eps,
        )?)),
        _ => Err(kernel_err(
            "layer_norm_backward",
            "needs float dy and x of one dtype".into(),
        )),
    }
}

impl NormKernels for CpuBackend {
    fn layer_norm(
        &self,
        x: &CpuArray,
        weight: &CpuArray,
        bias: &CpuArray,
        eps: f64,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        checked(
            "layer_norm",
            layer_norm(x, Some(weight), Some(bias), eps)?,
            out,
        )
    }
    fn layer_norm_backward(
        &self,
        x: &CpuArray,
        weight: &CpuArray,
        dy: &CpuArray,
        eps: f64,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        checked(
            "layer_norm_backward",
            layer_norm_backward(dy, x, Some(weight), eps)?,
            out,
        )
    }
}
