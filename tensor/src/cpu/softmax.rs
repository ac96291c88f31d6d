//! Softmax CPU kernels: softmax and log-softmax over one dim, and their backward.

use ndarray::{ArrayD, ArrayViewMutD, Axis, Zip};

use super::elementwise::PAR_THRESHOLD;
use super::float_input;
use super::{checked, CpuBackend};
use crate::element::FloatElement;
use crate::op::{OutSpec, SoftmaxKernels};
use crate::storage::CpuArray;
use crate::{Result, TensorError};

/// Runs `f` on every lane of `out` along `dim` (rayon when large).
fn for_lanes<F: FloatElement>(
    out: &mut ArrayD<F>,
    dim: usize,
    f: impl Fn(ArrayViewMutD<F>) + Sync + Send,
) {
    let big = out.len() >= PAR_THRESHOLD;
    let z = Zip::from(out.lanes_mut(Axis(dim)));
    if big {
        z.par_for_each(|l| f(l.into_dyn()));
    } else {
        z.for_each(|l| f(l.into_dyn()));
    }
}

fn softmax_t<F: FloatElement>(a: &ArrayD<F>, dim: usize, log: bool) -> ArrayD<F> {
    let mut out = a.to_owned();
    for_lanes(&mut out, dim, |mut lane| {
        let m = lane.fold(F::lowest(), |acc, &x| if x > acc { x } else { acc });
        let m = if m == F::lowest() {
            F::from_f64(0.0)
        } else {
            m
        };
        let mut s = F::from_f64(0.0);
        lane.iter().for_each(|&x| s += (x - m).exp());
        if log {
            let ls = s.ln() + m;
            lane.mapv_inplace(|x| x - ls);
        } else {
            let inv = s.recip();
            lane.mapv_inplace(|x| (x - m).exp() * inv);
        }
    });
    out
}

/// softmax or log_softmax over `dim`.
pub fn softmax(a: &CpuArray, dim: usize, log: bool) -> Result<CpuArray> {
    match a {
        CpuArray::F32(a) => Ok(CpuArray::F32(softmax_t(a, dim, log))),
        CpuArray::F64(a) => Ok(CpuArray::F64(softmax_t(a, dim, log))),
        a => Err(float_input(if log { "log_softmax" } else { "softmax" }, a)),
    }
}

fn softmax_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    y: &ArrayD<F>,
    dim: usize,
    log: bool,
) -> ArrayD<F> {
    // Per lane: softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy).
    let mut out = dy.to_owned();
    let big = out.len() >= PAR_THRESHOLD;
    let z = Zip::from(out.lanes_mut(Axis(dim))).and(y.lanes(Axis(dim)));
    let f = |mut g: ndarray::ArrayViewMut1<F>, y: ndarray::ArrayView1<F>| {
        if log {
            let s = g.sum();
            Zip::from(&mut g)
                .and(&y)
                .for_each(|g, &y| *g = *g - y.exp() * s);
        } else {
            let mut s = F::from_f64(0.0);
            Zip::from(&g).and(&y).for_each(|&g, &y| s += g * y);
            Zip::from(&mut g)
                .and(&y)
                .for_each(|g, &y| *g = y * (*g - s));
        }
    };
    if big {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
    out
}

/// Backward of softmax (`log` = false) or log_softmax over `dim`, from dy and the forward output y.
pub fn softmax_backward(dy: &CpuArray, y: &CpuArray, dim: usize, log: bool) -> Result<CpuArray> {
    match (dy, y) {
        (CpuArray::F32(g), CpuArray::F32(y)) => {
            Ok(CpuArray::F32(softmax_backward_t(g, y, dim, log)))
        }
        (CpuArray::F64(g), CpuArray::F64(y)) => {
            Ok(CpuArray::F64(softmax_backward_t(g, y, dim, log)))
        }
        _ => Err(TensorError::Kernel {
            op: if log {
                "log_softmax_backward"
            } else {
                "softmax_backward"
            },
            detail: "needs float dy and y of one dtype".into(),
        }),
    }
}

impl SoftmaxKernels for CpuBackend {
    fn softmax(&self, x: &CpuArray, dim: usize, log: bool, out: &OutSpec) -> Result<CpuArray> {
        checked("softmax", softmax(x, dim, log)?, out)
    }
    fn softmax_backward(
        &self,
        y: &CpuArray,
        dy: &CpuArray,
        dim: usize,
        log: bool,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        checked("softmax_backward", softmax_backward(dy, y, dim, log)?, out)
    }
}
