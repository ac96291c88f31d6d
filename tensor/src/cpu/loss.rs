//! Loss CPU kernels, written into the executor's output buffer: per-sample cross-entropy of
//! logits against labels and its logits gradient, and the vocabulary-parallel kernels on one
//! class shard (rayon over the rows when large).

use ndarray::{ArrayD, ArrayView1, ArrayView2, Axis, Zip};
use rayon::prelude::*;

use super::{check_ids, out_as, rows, view_mut_as, CpuBackend, PAR_THRESHOLD};
use crate::element::FloatElement;
use crate::op::{kernel_err, ClassShard, LossKernels};
use crate::storage::CpuArray;
use crate::Result;

/// log-sum-exp of one row.
fn lse<F: FloatElement>(r: ArrayView1<F>) -> F {
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

/// The logits as rows, once every label is one of their columns.
fn labelled_rows<'a, F: FloatElement>(
    op: &'static str,
    logits: &'a ArrayD<F>,
    labels: &ArrayD<i64>,
) -> Result<ArrayView2<'a, F>> {
    let l = rows(logits).ok_or_else(|| kernel_err(op, "logits must be 2-d".into()))?;
    check_ids(op, labels, l.ncols())?;
    Ok(l)
}

fn cross_entropy_t<F: FloatElement>(
    logits: &ArrayD<F>,
    labels: &ArrayD<i64>,
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "cross_entropy";
    let l = labelled_rows(op, logits, labels)?;
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
    let l = labelled_rows(op, logits, labels)?;
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
    let mut o2 = view_mut_as(op, out, l.raw_dim())?;
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

/// log-sum-exp of `values` in one pass: a running max and the sum of exponentials relative to
/// it, rescaled when the max grows; -inf for no values (or only -inf).
fn lse_one_pass<F: FloatElement>(values: impl Iterator<Item = F>) -> F {
    let zero = F::from_f64(0.0);
    let (mut m, mut s) = (F::lowest(), zero);
    for v in values {
        if v > m {
            s = s * (m - v).exp() + F::from_f64(1.0);
            m = v;
        } else {
            s += (v - m).exp();
        }
    }
    if s > zero {
        m + s.ln()
    } else {
        F::from_f64(f64::NEG_INFINITY)
    }
}

/// The logits piece as rows, with the per-row values (`[rows, 1]` or `[rows]`) fitting them.
fn shard_rows<'a, F: FloatElement>(
    op: &'static str,
    logits: &'a ArrayD<F>,
    per_row: &[usize],
) -> Result<ArrayView2<'a, F>> {
    let l = rows(logits)
        .filter(|_| logits.ndim() == 2)
        .ok_or_else(|| kernel_err(op, format!("logits {:?} are not [N, C]", logits.shape())))?;
    if let Some(&bad) = per_row.iter().find(|&&n| n != l.nrows()) {
        return Err(kernel_err(
            op,
            format!(
                "a per-row input or output of {bad} values for {} rows",
                l.nrows()
            ),
        ));
    }
    Ok(l)
}

fn vocab_parallel_lse_t<F: FloatElement>(
    logits: &ArrayD<F>,
    at: ClassShard,
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "vocab_parallel_log_sum_exp";
    if out.ndim() != 2 || out.shape()[1] != 1 {
        return Err(kernel_err(
            op,
            format!(
                "writes one column per class shard, got an output piece {:?}",
                out.shape()
            ),
        ));
    }
    let l = shard_rows(op, logits, &[out.len()])?;
    let cols = at.class_columns(l.ncols());
    let one = |(o, r): (&mut F, ArrayView1<'_, F>)| {
        *o = lse_one_pass(r.iter().take(cols).copied());
    };
    let o = out
        .as_slice_mut()
        .ok_or_else(|| kernel_err(op, "output is not contiguous".into()))?;
    if logits.len() >= PAR_THRESHOLD {
        o.par_iter_mut()
            .zip(l.axis_iter(Axis(0)).into_par_iter())
            .for_each(one);
    } else {
        o.iter_mut().zip(l.outer_iter()).for_each(one);
    }
    Ok(())
}

/// The column of `label` in a piece whose first column is global `start`, if it holds it.
fn label_column(label: i64, start: usize, width: usize) -> Option<usize> {
    (label as usize).checked_sub(start).filter(|&j| j < width)
}

/// What the vocab-parallel loss kernels read: the logits piece, the labels (global class
/// ids) and each row's log-sum-exp over all classes.
type VocabInputs<'a, F> = (&'a ArrayD<F>, &'a ArrayD<i64>, &'a ArrayD<F>);

/// The logits piece of `inputs` as rows ([`shard_rows`], with `per_row` more values per row),
/// once every label is a class of `at`.
fn vocab_rows<'a, F: FloatElement>(
    op: &'static str,
    (logits, labels, lse): VocabInputs<'a, F>,
    at: ClassShard,
    per_row: usize,
) -> Result<ArrayView2<'a, F>> {
    let l = shard_rows(op, logits, &[labels.len(), lse.len(), per_row])?;
    check_ids(op, labels, at.classes)?;
    Ok(l)
}

fn vocab_parallel_loss_t<F: FloatElement>(
    inputs: VocabInputs<'_, F>,
    at: ClassShard,
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "vocab_parallel_cross_entropy";
    let l = vocab_rows(op, inputs, at, out.len())?;
    let (_, labels, lse) = inputs;
    let zero = F::from_f64(0.0);
    for (((o, r), &t), &s) in out
        .iter_mut()
        .zip(l.outer_iter())
        .zip(labels.iter())
        .zip(lse.iter())
    {
        let target = label_column(t, at.start, r.len()).map_or(zero, |j| r[j]);
        *o = if at.start == 0 { s } else { zero } - target;
    }
    Ok(())
}

fn vocab_parallel_backward_t<F: FloatElement>(
    inputs: VocabInputs<'_, F>,
    dy: &ArrayD<F>,
    at: ClassShard,
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "vocab_parallel_cross_entropy_backward";
    let l = vocab_rows(op, inputs, at, dy.len())?;
    let (logits, labels, lse) = inputs;
    if out.shape() != logits.shape() {
        return Err(kernel_err(
            op,
            format!(
                "output {:?} does not fit logits {:?}",
                out.shape(),
                logits.shape()
            ),
        ));
    }
    let (width, cols) = (l.ncols(), at.class_columns(l.ncols()));
    let zero = F::from_f64(0.0);
    let o = out
        .as_slice_mut()
        .ok_or_else(|| kernel_err(op, "output is not contiguous".into()))?;
    let per_row: Vec<(i64, F, F)> = labels
        .iter()
        .zip(lse.iter())
        .zip(dy.iter())
        .map(|((&t, &s), &g)| (t, s, g))
        .collect();
    let row = |(i, o): (usize, &mut [F])| {
        let (t, s, g) = per_row[i];
        let label = label_column(t, at.start, width);
        for (j, (o, &x)) in o.iter_mut().zip(l.row(i).iter()).enumerate().take(cols) {
            *o = (x - s).exp() * g;
            if Some(j) == label {
                *o = *o - g;
            }
        }
        o[cols..].fill(zero);
    };
    if width == 0 {
        return Ok(());
    }
    if o.len() >= PAR_THRESHOLD {
        o.par_chunks_mut(width).enumerate().for_each(row);
    } else {
        o.chunks_mut(width).enumerate().for_each(row);
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
        with_floats!(op, "needs float logits and i64 labels";
            (logits) as (l), labels => I64(y) => cross_entropy_t(l, y, out_as(op, out)?)
        )
    }
    fn cross_entropy_backward(
        &self,
        logits: &CpuArray,
        labels: &CpuArray,
        dy: &CpuArray,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "cross_entropy_backward";
        with_floats!(op, "needs float dy/logits and i64 labels";
            (dy, logits) as (g, l), labels => I64(y) => {
                cross_entropy_backward_t(g, l, y, out_as(op, out)?)
            }
        )
    }

    fn vocab_parallel_lse(
        &self,
        logits: &CpuArray,
        at: ClassShard,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "vocab_parallel_log_sum_exp";
        with_floats!(op, "needs float logits"; (logits) as (l) => {
            vocab_parallel_lse_t(l, at, out_as(op, out)?)
        })
    }
    fn vocab_parallel_loss(
        &self,
        logits: &CpuArray,
        labels: &CpuArray,
        lse: &CpuArray,
        at: ClassShard,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "vocab_parallel_cross_entropy";
        with_floats!(op, "needs float logits and lse of one dtype and i64 labels";
            (logits, lse) as (l, s), labels => I64(y) => {
                vocab_parallel_loss_t((l, y, s), at, out_as(op, out)?)
            }
        )
    }
    fn vocab_parallel_backward(
        &self,
        logits: &CpuArray,
        labels: &CpuArray,
        lse: &CpuArray,
        dy: &CpuArray,
        at: ClassShard,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "vocab_parallel_cross_entropy_backward";
        with_floats!(op, "needs float logits, lse and dy of one dtype and i64 labels";
            (logits, lse, dy) as (l, s, g), labels => I64(y) => {
                vocab_parallel_backward_t((l, y, s), g, at, out_as(op, out)?)
            }
        )
    }
}
