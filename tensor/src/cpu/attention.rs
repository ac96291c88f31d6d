//! Attention probabilities CPU kernel, per (batch, head) pair and written into the executor's
//! output buffer: scores `q k^T` by matrixmultiply straight into the output, then a numerically
//! stable softmax of `scores * scale` per query row (causal rows only up to the row's own
//! index, the rest 0); rayon over the pairs when large.

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayD, ArrayView2, ArrayView3, ArrayViewD, ArrayViewMut2, Axis};
use oxiflow_dtype::MatmulPrecision;

use super::PAR_THRESHOLD;
use super::{out_as, try_for_each_indexed, view_mut_as, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, AttentionKernels};
use crate::storage::CpuArray;
use crate::Result;

/// Softmax of `scale * row` over each row of `s` elements of `p`, in place; with `causal`, row
/// `i` covers columns `0..=i` and the rest become 0.
fn softmax_rows<F: FloatElement>(p: &mut [F], s: usize, causal: bool, scale: F) {
    if s == 0 {
        return;
    }
    let zero = F::from_f64(0.0);
    for (i, row) in p.chunks_mut(s).enumerate() {
        let live = if causal { (i + 1).min(s) } else { s };
        let (live, masked) = row.split_at_mut(live);
        let mut m = F::lowest();
        for v in live.iter_mut() {
            *v *= scale;
            if *v > m {
                m = *v;
            }
        }
        if m == F::lowest() {
            m = zero;
        }
        let mut sum = zero;
        for v in live.iter_mut() {
            *v = (*v - m).exp();
            sum += *v;
        }
        let inv = sum.recip();
        live.iter_mut().for_each(|v| *v *= inv);
        masked.iter_mut().for_each(|v| *v = zero);
    }
}

/// One (batch, head) pair: the probabilities `[T, S]` into `out`.
fn pair<F: FloatElement>(
    q: ArrayView2<'_, F>,
    k: ArrayView2<'_, F>,
    causal: bool,
    scale: F,
    mut out: ArrayViewMut2<'_, F>,
) -> Result<()> {
    let (zero, one) = (F::from_f64(0.0), F::from_f64(1.0));
    general_mat_mul(one, &q, &k.t(), zero, &mut out);
    let rows = out
        .as_slice_mut()
        .ok_or_else(|| kernel_err("attention_probs", "output not contiguous".into()))?;
    softmax_rows(rows, k.nrows(), causal, scale);
    Ok(())
}

/// The dims of a 4-d piece.
fn dims4<F>(a: &ArrayD<F>, op: &'static str, what: &str) -> Result<[usize; 4]> {
    match *a.shape() {
        [b, h, n, d] => Ok([b, h, n, d]),
        _ => Err(kernel_err(
            op,
            format!("{what} piece must be 4-d, got {:?}", a.shape()),
        )),
    }
}

/// `a` `[B, H, n, d]` viewed as `[B * H, n, d]` (standard layout).
fn pairs_view<'a, F>(a: ArrayViewD<'a, F>, op: &'static str) -> Result<ArrayView3<'a, F>> {
    let shape = a.shape().to_vec();
    let bad = || kernel_err(op, format!("piece {shape:?} is not [B, H, n, d]"));
    let [b, h, n, d] = shape[..] else {
        return Err(bad());
    };
    let bh = b.checked_mul(h).ok_or_else(bad)?;
    a.into_shape_with_order((bh, n, d))
        .map_err(|e| kernel_err(op, e.to_string()))
}

fn probs_t<F: FloatElement>(
    q: &ArrayD<F>,
    k: &ArrayD<F>,
    (causal, scale): (bool, f64),
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "attention_probs";
    let [b, h, t, d] = dims4(q, op, "q")?;
    let [kb, kh, s, kd] = dims4(k, op, "k")?;
    if [kb, kh, kd] != [b, h, d] || (causal && s != t) || out.shape() != [b, h, t, s] {
        return Err(kernel_err(
            op,
            format!(
                "k {:?} does not fit q {:?} (output {:?})",
                k.shape(),
                q.shape(),
                out.shape()
            ),
        ));
    }
    let (q, k) = (q.as_standard_layout(), k.as_standard_layout());
    let (q3, k3) = (pairs_view(q.view(), op)?, pairs_view(k.view(), op)?);
    let mut o3 = view_mut_as(op, out, (b * h, t, s))?;
    let scale = F::from_f64(scale);
    let run = |(i, o): (usize, ArrayViewMut2<'_, F>)| {
        pair(
            q3.index_axis(Axis(0), i),
            k3.index_axis(Axis(0), i),
            causal,
            scale,
            o,
        )
    };
    let work = q3
        .len_of(Axis(0))
        .saturating_mul(t)
        .saturating_mul(s.max(1));
    let big = work.saturating_mul(d.max(1)) >= PAR_THRESHOLD;
    try_for_each_indexed(o3.outer_iter_mut(), big, run)
}

impl AttentionKernels for CpuBackend {
    fn attention_probs(
        &self,
        q: &CpuArray,
        k: &CpuArray,
        causal: bool,
        scale: f64,
        _precision: MatmulPrecision,
        out: &mut CpuArray,
    ) -> Result<()> {
        let (op, attrs) = ("attention_probs", (causal, scale));
        with_floats!(op, "needs float q and k of one dtype"; (q, k) as (q, k) => {
            probs_t(q, k, attrs, out_as(op, out)?)
        })
    }
}
