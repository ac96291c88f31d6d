//! Normalization CPU kernels, written into the executor's output buffers: layer norm over the
//! last dim (with each row's mean and 1/std) and its input gradient from those statistics, one
//! row at a time (rayon when large).

use ndarray::{ArrayD, ArrayView1, ArrayViewMut1, Axis, Ix1, Zip};

use super::{out_as, rows, view_mut_as, CpuBackend};
use crate::element::FloatElement;
use crate::op::{composed_layer_norm_grads, kernel_err, NormKernels};
use crate::storage::CpuArray;
use crate::Result;

/// A 1-d array as a 1-d view.
fn vector<'a, F>(op: &'static str, a: &'a ArrayD<F>) -> Result<ArrayView1<'a, F>> {
    a.view()
        .into_dimensionality::<Ix1>()
        .map_err(|e| kernel_err(op, e.to_string()))
}

/// Mean and 1/std of one row.
fn moments<F: FloatElement>(x: ndarray::ArrayView1<F>, eps: F) -> (F, F) {
    let n = F::from_f64(x.len().max(1) as f64);
    let mean = x.sum() / n;
    let mut var = F::from_f64(0.0);
    x.iter().for_each(|&v| var += (v - mean) * (v - mean));
    (mean, (var / n + eps).sqrt().recip())
}

/// A `[rows, 1]` statistics buffer as its `rows` values.
fn column<'a, F>(op: &'static str, a: &'a mut ArrayD<F>, rows: usize) -> Result<&'a mut [F]> {
    let n = a.len();
    a.as_slice_mut()
        .filter(|_| n == rows)
        .ok_or_else(|| kernel_err(op, format!("statistics of {n} elements for {rows} rows")))
}

fn layer_norm_t<F: FloatElement>(
    (x, w, b): (&ArrayD<F>, &ArrayD<F>, &ArrayD<F>),
    eps: f64,
    y: &mut ArrayD<F>,
    mean: &mut ArrayD<F>,
    rstd: &mut ArrayD<F>,
) -> Result<()> {
    let op = "layer_norm";
    let eps = F::from_f64(eps);
    let xr = rows(x).ok_or_else(|| kernel_err(op, "needs a dim".into()))?;
    let (n, h) = (xr.nrows(), xr.ncols());
    if w.shape() != [h] || b.shape() != [h] || y.shape() != x.shape() {
        return Err(kernel_err(
            op,
            format!(
                "weight {:?}, bias {:?} and output {:?} do not fit rows of {h}",
                w.shape(),
                b.shape(),
                y.shape()
            ),
        ));
    }
    let (w, b) = (vector(op, w)?, vector(op, b)?);
    let (ms, rs) = (column(op, mean, n)?, column(op, rstd, n)?);
    let mut y2 = view_mut_as(op, y, (n, h))?;
    let f = |mut y: ArrayViewMut1<F>, x: ArrayView1<F>, m: &mut F, r: &mut F| {
        let (mean, rstd) = moments(x, eps);
        (*m, *r) = (mean, rstd);
        Zip::from(&mut y)
            .and(&x)
            .and(&w)
            .and(&b)
            .for_each(|y, &x, &w, &b| *y = (x - mean) * rstd * w + b);
    };
    for_each_row!(n * h, f;
        y2.axis_iter_mut(Axis(0)),
        xr.axis_iter(Axis(0)),
        ArrayViewMut1::from(ms),
        ArrayViewMut1::from(rs),
    );
    Ok(())
}

fn layer_norm_backward_t<F: FloatElement>(
    (x, w, dy): (&ArrayD<F>, &ArrayD<F>, &ArrayD<F>),
    (mean, rstd): (&ArrayD<F>, &ArrayD<F>),
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "layer_norm_backward";
    let xr = rows(x).ok_or_else(|| kernel_err(op, "needs a dim".into()))?;
    let gr = rows(dy).ok_or_else(|| kernel_err(op, "needs a dim".into()))?;
    let (n, h) = (xr.nrows(), xr.ncols());
    if w.shape() != [h] || dy.shape() != x.shape() || out.shape() != x.shape() {
        return Err(kernel_err(
            op,
            format!(
                "weight {:?}, dy {:?} and output {:?} do not fit x {:?}",
                w.shape(),
                dy.shape(),
                out.shape(),
                x.shape()
            ),
        ));
    }
    let (ms, rs) = (mean.as_slice(), rstd.as_slice());
    let (Some(ms), Some(rs)) = (ms.filter(|m| m.len() == n), rs.filter(|r| r.len() == n)) else {
        return Err(kernel_err(
            op,
            format!(
                "mean {:?} and rstd {:?} for {n} rows",
                mean.shape(),
                rstd.shape()
            ),
        ));
    };
    let hf = F::from_f64(h.max(1) as f64);
    let w = vector(op, w)?;
    let mut o2 = view_mut_as(op, out, (n, h))?;
    let f = |mut d: ArrayViewMut1<F>, g: ArrayView1<F>, x: ArrayView1<F>, &mean: &F, &rstd: &F| {
        let (mut sg, mut sgx) = (F::from_f64(0.0), F::from_f64(0.0));
        Zip::from(&g).and(&x).and(&w).for_each(|&g, &x, &w| {
            let gv = g * w;
            sg += gv;
            sgx += gv * (x - mean) * rstd;
        });
        let (mg, mgx) = (sg / hf, sgx / hf);
        Zip::from(&mut d)
            .and(&g)
            .and(&x)
            .and(&w)
            .for_each(|d, &g, &x, &w| {
                let xh = (x - mean) * rstd;
                *d = rstd * (g * w - mg - xh * mgx);
            });
    };
    for_each_row!(n * h, f;
        o2.axis_iter_mut(Axis(0)),
        gr.axis_iter(Axis(0)),
        xr.axis_iter(Axis(0)),
        ArrayView1::from(ms),
        ArrayView1::from(rs),
    );
    Ok(())
}

impl NormKernels for CpuBackend {
    fn layer_norm_grads(
        &self,
        x: [&CpuArray; 5],
        dr: Option<&CpuArray>,
        out: [&mut CpuArray; 3],
    ) -> Result<()> {
        composed_layer_norm_grads(self, x, dr, out)
    }
    fn layer_norm(
        &self,
        x: &CpuArray,
        weight: &CpuArray,
        bias: &CpuArray,
        eps: f64,
        y: &mut CpuArray,
        mean: &mut CpuArray,
        rstd: &mut CpuArray,
    ) -> Result<()> {
        let op = "layer_norm";
        with_floats!(op, "needs float x, weight and bias of one dtype";
            (x, weight, bias) as (x, w, b) => layer_norm_t(
                (x, w, b),
                eps,
                out_as(op, y)?,
                out_as(op, mean)?,
                out_as(op, rstd)?,
            )
        )
    }
    fn layer_norm_backward(
        &self,
        x: &CpuArray,
        weight: &CpuArray,
        dy: &CpuArray,
        mean: &CpuArray,
        rstd: &CpuArray,
        dx: &mut CpuArray,
    ) -> Result<()> {
        let op = "layer_norm_backward";
        with_floats!(op, "needs float x, weight, dy, mean and rstd of one dtype";
            (x, weight, dy, mean, rstd) as (x, w, g, m, r) => {
                layer_norm_backward_t((x, w, g), (m, r), out_as(op, dx)?)
            }
        )
    }
}
