//! Candidate tables of the cross-entropy loss (per sample) and its backward.

use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

fn check(logits: &Shape, labels: &Shape) -> Result<(), String> {
    if logits.ndim() != 2 || labels.ndim() != 1 || labels.dim(0) != logits.dim(0) {
        return Err(format!(
            "needs logits [N, C] and labels [N], got logits {logits} and labels {labels}"
        ));
    }
    Ok(())
}

/// (logits [N, C], labels [N]) -> per-sample loss [N]: (S(0), S(0))->S(0); (B, B)->B.
/// Splitting the classes would need a collective inside the op, so it is not offered.
pub fn forward(logits: &Shape, labels: &Shape, mode: RuleMode) -> Result<Rules, String> {
    check(logits, labels)?;
    let mut r = Rules::new(mode, [labels.clone()]);
    r.push(&[Sbp::S(0), Sbp::S(0)], &[Sbp::S(0)]);
    r.push(&[B, B], &[B]);
    Ok(r)
}

/// (logits, labels, dloss [N]) -> dlogits [N, C]: S(0) on all -> S(0); (B, B, P)->P (linear
/// in dloss); all B -> B.
pub fn backward(xs: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    check(xs[0], xs[1])?;
    if xs[2] != xs[1] {
        return Err(format!(
            "dloss {} must have the labels' shape {}",
            xs[2], xs[1]
        ));
    }
    let mut r = Rules::new(mode, [xs[0].clone()]);
    r.push(&[Sbp::S(0), Sbp::S(0), Sbp::S(0)], &[Sbp::S(0)]);
    r.push(&[B, B, P], &[P]);
    r.push(&[B, B, B], &[B]);
    Ok(r)
}
