//! Softmax CPU kernels, written into the executor's output buffer: softmax and log-softmax over
//! one dim, and their backward; one lane at a time (rayon when large).

use ndarray::{ArrayD, ArrayView1, ArrayViewMut1, Axis, Zip};
use oxiflow_dtype::MatmulPrecision;

use super::PAR_THRESHOLD;
use super::{fits, float_input, out_as, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, SoftmaxKernels};
use crate::storage::CpuArray;
use crate::Result;

fn softmax_t<F: FloatElement>(a: &ArrayD<F>, dim: usize, log: bool, out: &mut ArrayD<F>) {
    let big = out.len() >= PAR_THRESHOLD;
    let f = |mut o: ArrayViewMut1<F>, x: ArrayView1<F>| {
        let m = x.fold(F::lowest(), |acc, &v| if v > acc { v } else { acc });
        let m = if m == F::lowest() {
            F::from_f64(0.0)
        } else {
            m
        };
        let mut s = F::from_f64(0.0);
        if log {
            x.iter().for_each(|&v| s += (v - m).exp());
            let ls = s.ln() + m;
            Zip::from(&mut o).and(&x).for_each(|o, &v| *o = v - ls);
        } else {
            Zip::from(&mut o).and(&x).for_each(|o, &v| {
                *o = (v - m).exp();
                s += *o;
            });
            let inv = s.recip();
            o.mapv_inplace(|v| v * inv);
        }
    };
    let z = Zip::from(out.lanes_mut(Axis(dim))).and(a.lanes(Axis(dim)));
    if big {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
}

/// softmax or log_softmax over `dim` into `out`.
fn softmax(a: &CpuArray, dim: usize, log: bool, out: &mut CpuArray) -> Result<()> {
    let op = if log { "log_softmax" } else { "softmax" };
    fits(op, a.shape(), out.shape())?;
    if dim >= a.shape().len() {
        return Err(kernel_err(op, format!("dim {dim} out of range")));
    }
    match a {
        CpuArray::F32(a) => softmax_t(a, dim, log, out_as(op, out)?),
        CpuArray::F64(a) => softmax_t(a, dim, log, out_as(op, out)?),
        a => return Err(float_input(op, a)),
    }
    Ok(())
}

fn softmax_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    y: &ArrayD<F>,
    dim: usize,
    log: bool,
    out: &mut ArrayD<F>,
) {
    // Per lane: softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy).
    let big = out.len() >= PAR_THRESHOLD;
    let f = |o: ArrayViewMut1<F>, g: ArrayView1<F>, y: ArrayView1<F>| {
        if log {
            let s = g.sum();
            Zip::from(o)
                .and(&g)
                .and(&y)
                .for_each(|o, &g, &y| *o = g - y.exp() * s);
        } else {
            let mut s = F::from_f64(0.0);
            Zip::from(&g).and(&y).for_each(|&g, &y| s += g * y);
            Zip::from(o)
                .and(&g)
                .and(&y)
                .for_each(|o, &g, &y| *o = y * (g - s));
        }
    };
    let z = Zip::from(out.lanes_mut(Axis(dim)))
        .and(dy.lanes(Axis(dim)))
        .and(y.lanes(Axis(dim)));
    if big {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
}

/// Backward of softmax (`log` = false) or log_softmax over `dim`, from dy and the forward output
/// y, into `out`.
fn softmax_backward(
    dy: &CpuArray,
    y: &CpuArray,
    dim: usize,
    log: bool,
    out: &mut CpuArray,
) -> Result<()> {
    let op = if log {
        "log_softmax_backward"
    } else {
        "softmax_backward"
    };
    fits(op, dy.shape(), out.shape())?;
    fits(op, y.shape(), out.shape())?;
    if dim >= y.shape().len() {
        return Err(kernel_err(op, format!("dim {dim} out of range")));
    }
    with_floats!(op, "needs float dy and y of one dtype"; (dy, y) as (g, y) => {
        softmax_backward_t(g, y, dim, log, out_as(op, out)?);
        Ok(())
    })
}

impl SoftmaxKernels for CpuBackend {
    fn softmax(&self, x: &CpuArray, dim: usize, log: bool, out: &mut CpuArray) -> Result<()> {
        softmax(x, dim, log, out)
    }
    fn softmax_backward(
        &self,
        y: &CpuArray,
        dy: &CpuArray,
        dim: usize,
        log: bool,
        _feeds: MatmulPrecision,
        out: &mut CpuArray,
    ) -> Result<()> {
        softmax_backward(dy, y, dim, log, out)
    }
}
