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

/// The fused classifier (logits `[N, V]`, per-row values `[N]`) -> (loss `[N]`, dlogits): rows
/// split or whole; never P (not linear), the classes whole.
pub fn classifier(logits: &Shape, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [Shape::new([logits.dim(0)]), logits.clone()]);
    r.push(&[Sbp::S(0), Sbp::S(0)], &[Sbp::S(0), Sbp::S(0)]);
    r.push(&[B, B], &[B, B]);
    r
}

/// Its backward (the saved dlogits, dloss `[N]`) -> dlogits scaled per row: rows split, classes
/// split with dloss whole, linear in dloss, or whole.
pub fn classifier_backward(logits: &Shape, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [logits.clone()]);
    r.push(&[Sbp::S(0), Sbp::S(0)], &[Sbp::S(0)]);
    r.push(&[Sbp::S(1), B], &[Sbp::S(1)]);
    r.push(&[B, P], &[P]);
    r.push(&[B, B], &[B]);
    r
}

/// The log-sum-exp partials `[N, parts]` of logits `[N, C]` (the first `classes` columns are
/// classes): per mesh axis, the logits' SBP.
pub fn vocab_parallel_lse(
    x: &Shape,
    classes: usize,
    parts: usize,
    mode: RuleMode,
) -> Result<Rules, String> {
    match x.dims() {
        [n, c] if parts >= 1 && (1..=*c).contains(&classes) => {
            let mut r = Rules::new(mode, [Shape::from([*n, parts])]);
            for sbp in [Sbp::S(1), Sbp::S(0), B] {
                r.push(&[sbp], &[sbp]);
            }
            Ok(r)
        }
        _ => Err(format!(
            "needs logits [N, C] with classes {classes} in 1..=C and at least one class \
             shard, got {x} and {parts} shards"
        )),
    }
}

/// The vocabulary-parallel loss (logits, labels, lse) -> loss `[N, 1]` and its backward (and dy)
/// -> dlogits, per mesh axis: logits split on the classes with the per-row inputs B -> loss P /
/// dlogits S(1); all split on the rows -> S(0); all B -> B.
pub fn vocab_parallel(s: &[&Shape], classes: usize, mode: RuleMode) -> Result<Rules, String> {
    let Some(x) = s.first() else {
        return Err("needs logits, labels and lse".into());
    };
    let rows = Shape::from([x.dims().first().copied().unwrap_or(0), 1]);
    let classes_fit = x.ndim() == 2 && (1..=x.dim(1)).contains(&classes);
    if !classes_fit || s[1..].iter().any(|t| **t != rows) {
        return Err(format!(
            "needs logits [N, C] with classes {classes} in 1..=C and labels, lse (and dy) \
             [N, 1], got {}",
            s.iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let n = s.len();
    let mut r = Rules::new(mode, [if n == 3 { rows } else { (*x).clone() }]);
    let mut ins = vec![B; n];
    ins[0] = Sbp::S(1);
    r.push(&ins, &[if n == 3 { P } else { Sbp::S(1) }]);
    r.push(&vec![Sbp::S(0); n], &[Sbp::S(0)]);
    r.push(&vec![B; n], &[B]);
    Ok(r)
}
