//! Loss CPU kernels: per-sample cross-entropy of logits against labels and its logits gradient.

use ndarray::{ArrayD, IxDyn};

use super::{check_ids, checked, rows, CpuBackend};
use crate::element::FloatElement;
use crate::op::kernel_err;
use crate::op::{LossKernels, OutSpec};
use crate::storage::CpuArray;
use crate::Result;

/// log-sum-exp of one row.
fn lse<F: FloatElement>(r: ndarray::ArrayView1<F>) -> F {
    let m = r.fold(F::lowest(), |a, &x| if x > a { x } else { a });
    let m = if m == F::lowest() {
        F::from_f64(0.0)
    } else {
        m
    };
    let mut s = F::from_f64(0.0);
    r.iter().for_each(|&x| s += (x - m).exp());
    s.ln() + m
}

fn check_labels(op: &'static str, labels: &ArrayD<i64>, c: usize) -> Result<()> {
    check_ids(op, labels, c)
}

fn cross_entropy_t<F: FloatElement>(logits: &ArrayD<F>, labels: &ArrayD<i64>) -> Result<ArrayD<F>> {
    let l = rows(logits).ok_or_else(|| kernel_err("cross_entropy", "logits must be 2-d".into()))?;
    check_labels("cross_entropy", labels, l.ncols())?;
    let out: Vec<F> = l
        .outer_iter()
        .zip(labels.iter())
        .map(|(r, &y)| lse(r) - r[y as usize])
        .collect();
    ArrayD::from_shape_vec(IxDyn(&[out.len()]), out)
        .map_err(|e| kernel_err("cross_entropy", e.to_string()))
}

/// Per-sample loss of logits [N, C] against labels [N].
pub fn cross_entropy(logits: &CpuArray, labels: &CpuArray) -> Result<CpuArray> {
    match (logits, labels) {
        (CpuArray::F32(l), CpuArray::I64(y)) => Ok(CpuArray::F32(cross_entropy_t(l, y)?)),
        (CpuArray::F64(l), CpuArray::I64(y)) => Ok(CpuArray::F64(cross_entropy_t(l, y)?)),
        _ => Err(kernel_err(
            "cross_entropy",
            "needs float logits and i64 labels".into(),
        )),
    }
}

fn cross_entropy_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    logits: &ArrayD<F>,
    labels: &ArrayD<i64>,
) -> Result<ArrayD<F>> {
    let l = rows(logits)
        .ok_or_else(|| kernel_err("cross_entropy_backward", "logits must be 2-d".into()))?;
    check_labels("cross_entropy_backward", labels, l.ncols())?;
    let mut out = l.to_owned();
    for ((mut r, &y), &g) in out.outer_iter_mut().zip(labels.iter()).zip(dy.iter()) {
        let s = lse(r.view());
        r.mapv_inplace(|x| (x - s).exp() * g);
        r[y as usize] = r[y as usize] - g;
    }
    Ok(out.into_dyn())
}

/// dlogits [N, C] = dy[n] * (softmax(logits[n]) - onehot(labels[n])).
pub fn cross_entropy_backward(
    dy: &CpuArray,
    logits: &CpuArray,
    labels: &CpuArray,
) -> Result<CpuArray> {
    match (dy, logits, labels) {
        (CpuArray::F32(g), CpuArray::F32(l), CpuArray::I64(y)) => {
            Ok(CpuArray::F32(cross_entropy_backward_t(g, l, y)?))
        }
        (CpuArray::F64(g), CpuArray::F64(l), CpuArray::I64(y)) => {
            Ok(CpuArray::F64(cross_entropy_backward_t(g, l, y)?))
        }
        _ => Err(kernel_err(
            "cross_entropy_backward",
            "needs float dy/logits and i64 labels".into(),
        )),
    }
}

impl LossKernels for CpuBackend {
    fn cross_entropy(
        &self,
        logits: &CpuArray,
        labels: &CpuArray,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        checked("cross_entropy", cross_entropy(logits, labels)?, out)
    }
    fn cross_entropy_backward(
        &self,
        logits: &CpuArray,
        labels: &CpuArray,
        dy: &CpuArray,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        checked(
            "cross_entropy_backward",
            cross_entropy_backward(dy, logits, labels)?,
            out,
        )
    }
}
