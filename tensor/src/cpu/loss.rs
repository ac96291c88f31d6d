//! Loss CPU kernels, written into the executor's output buffer: per-sample cross-entropy of
//! logits against labels and its logits gradient.

use ndarray::{ArrayD, Zip};

use super::{check_ids, out_as, rows, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, LossKernels};
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

fn cross_entropy_t<F: FloatElement>(
    logits: &ArrayD<F>,
    labels: &ArrayD<i64>,
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "cross_entropy";
    let l = rows(logits).ok_or_else(|| kernel_err(op, "logits must be 2-d".into()))?;
    check_labels(op, labels, l.ncols())?;
    if labels.len() != l.nrows() || out.len() != l.nrows() {
        return Err(kernel_err(
            op,
            format!(
                "labels {:?} and output {:?} do not fit {} rows",
                labels.shape(),
                out.shape(),
                l.nrows()
            ),
        ));
    }
    for ((o, r), &y) in out.iter_mut().zip(l.outer_iter()).zip(labels.iter()) {
        *o = lse(r) - r[y as usize];
    }
    Ok(())
}

fn cross_entropy_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    logits: &ArrayD<F>,
    labels: &ArrayD<i64>,
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "cross_entropy_backward";
    let l = rows(logits).ok_or_else(|| kernel_err(op, "logits must be 2-d".into()))?;
    check_labels(op, labels, l.ncols())?;
    if labels.len() != l.nrows() || dy.len() != l.nrows() || out.shape() != logits.shape() {
        return Err(kernel_err(
            op,
            format!(
                "labels {:?}, dy {:?} and output {:?} do not fit logits {:?}",
                labels.shape(),
                dy.shape(),
                out.shape(),
                logits.shape()
            ),
        ));
    }
    let mut o2 = out
        .view_mut()
        .into_shape_with_order(l.raw_dim())
        .map_err(|e| kernel_err(op, e.to_string()))?;
    for (((mut o, r), &y), &g) in o2
        .outer_iter_mut()
        .zip(l.outer_iter())
        .zip(labels.iter())
        .zip(dy.iter())
    {
        let s = lse(r);
        Zip::from(&mut o)
            .and(&r)
            .for_each(|o, &x| *o = (x - s).exp() * g);
        o[y as usize] = o[y as usize] - g;
    }
    Ok(())
}

impl LossKernels for CpuBackend {
    fn cross_entropy(
        &self,
        logits: &CpuArray,
        labels: &CpuArray,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "cross_entropy";
        match (logits, labels) {
            (CpuArray::F32(l), CpuArray::I64(y)) => cross_entropy_t(l, y, out_as(op, out)?),
            (CpuArray::F64(l), CpuArray::I64(y)) => cross_entropy_t(l, y, out_as(op, out)?),
            _ => Err(kernel_err(op, "needs float logits and i64 labels".into())),
        }
    }
    fn cross_entropy_backward(
        &self,
        logits: &CpuArray,
        labels: &CpuArray,
        dy: &CpuArray,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "cross_entropy_backward";
        match (dy, logits, labels) {
            (CpuArray::F32(g), CpuArray::F32(l), CpuArray::I64(y)) => {
                cross_entropy_backward_t(g, l, y, out_as(op, out)?)
            }
            (CpuArray::F64(g), CpuArray::F64(l), CpuArray::I64(y)) => {
                cross_entropy_backward_t(g, l, y, out_as(op, out)?)
            }
            _ => Err(kernel_err(
                op,
                "needs float dy/logits and i64 labels".into(),
            )),
        }
    }
}
