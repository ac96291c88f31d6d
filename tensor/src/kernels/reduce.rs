//! Reduction CPU kernels: sum/mean/max over dims, softmax/log_softmax (and their backward),
//! and sum-to-shape (the reverse of broadcasting).

use ndarray::{ArrayD, ArrayViewMutD, Axis, IxDyn, Zip};

use crate::element::{FloatElement, TensorElement};
use crate::kernels::elementwise::PAR_THRESHOLD;
use crate::storage::CpuArray;
use crate::{Result, TensorError};

fn reduce_dims<T: TensorElement>(
    a: &ArrayD<T>,
    dims: &[usize],
    keepdim: bool,
    max: bool,
) -> ArrayD<T> {
    let mut sorted: Vec<usize> = dims.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = a.clone();
    for &d in sorted.iter().rev() {
        out = if max {
            out.fold_axis(
                Axis(d),
                T::lowest(),
                |&acc, &x| if x > acc { x } else { acc },
            )
        } else {
            out.sum_axis(Axis(d))
        };
        if keepdim {
            out = out.insert_axis(Axis(d));
        }
    }
    out
}

/// Sum (or max) over `dims`.
pub fn reduce(a: &CpuArray, dims: &[usize], keepdim: bool, max: bool) -> CpuArray {
    match a {
        CpuArray::F32(a) => CpuArray::F32(reduce_dims(a, dims, keepdim, max)),
        CpuArray::F64(a) => CpuArray::F64(reduce_dims(a, dims, keepdim, max)),
        CpuArray::I64(a) => CpuArray::I64(reduce_dims(a, dims, keepdim, max)),
    }
}

/// Sum over `dims` times 1 / `count` (`count` = 0: the number of reduced elements of `a`).
pub fn mean(a: &CpuArray, dims: &[usize], keepdim: bool, count: usize) -> Result<CpuArray> {
    let count = if count == 0 {
        dims.iter().map(|&d| a.shape()[d]).product::<usize>()
    } else {
        count
    };
    let inv = 1.0 / count as f64;
    Ok(match reduce(a, dims, keepdim, false) {
        CpuArray::F32(s) => CpuArray::F32(s * inv as f32),
        CpuArray::F64(s) => CpuArray::F64(s * inv),
        CpuArray::I64(_) => {
            return Err(TensorError::Kernel {
                op: "mean",
                detail: "needs a float input".into(),
            })
        }
    })
}

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
        CpuArray::I64(_) => Err(TensorError::Kernel {
            op: if log { "log_softmax" } else { "softmax" },
            detail: "needs a float input".into(),
        }),
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

/// Sums `a` down to `shape` (which broadcasts to `a`'s shape).
pub fn sum_to_shape(a: &CpuArray, shape: &[usize]) -> Result<CpuArray> {
    let s = a.shape();
    let lead = s.len() - shape.len();
    let dims: Vec<usize> = (0..s.len())
        .filter(|&d| d < lead || (shape[d - lead] == 1 && s[d] != 1))
        .collect();
    let r = reduce(a, &dims, true, false);
    fn reshape<T: TensorElement>(a: ArrayD<T>, shape: &[usize]) -> Option<ArrayD<T>> {
        a.into_shape_with_order(IxDyn(shape)).ok()
    }
    let out = match r {
        CpuArray::F32(a) => reshape(a, shape).map(CpuArray::F32),
        CpuArray::F64(a) => reshape(a, shape).map(CpuArray::F64),
        CpuArray::I64(a) => reshape(a, shape).map(CpuArray::I64),
    };
    out.ok_or_else(|| TensorError::Kernel {
        op: "sum_to_shape",
        detail: format!("cannot sum {s:?} to {shape:?}"),
    })
}
