//! Candidate tables of concat and slice (narrow): ops that select along one dim.

use super::{RuleMode, Rules, PARTIALS};
use crate::{Sbp, Shape};

/// Concat along `dim`: S(i != dim) on all inputs -> S(i); all B -> B; all P(op) -> P(op).
pub fn concat(dim: usize, xs: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    let first = xs[0];
    let n = first.ndim();
    if dim >= n {
        return Err(format!("dim {dim} out of range for input {first}"));
    }
    for x in xs {
        let same = x.ndim() == n && (0..n).all(|i| i == dim || x.dim(i) == first.dim(i));
        if !same {
            return Err(format!(
                "input {x} does not match {first} outside dim {dim}"
            ));
        }
    }
    let total: usize = xs.iter().map(|x| x.dim(dim)).sum();
    let k = xs.len();
    let mut r = Rules::new(mode, [first.with_dim(dim, total)]);
    for i in (0..n).filter(|&i| i != dim) {
        let ins = vec![Sbp::S(i); k];
        r.push(&ins, &[Sbp::S(i)]);
    }
    r.push_uniform(k, 1, Sbp::Broadcast);
    for m in PARTIALS {
        r.push_uniform(k, 1, m);
    }
    Ok(r)
}

/// Keep `start..end` of `dim`: S(i != dim) -> S(i); B->B; any P->P.
pub fn slice(
    dim: usize,
    start: usize,
    end: usize,
    x: &Shape,
    mode: RuleMode,
) -> Result<Rules, String> {
    if dim >= x.ndim() {
        return Err(format!("dim {dim} out of range for input {x}"));
    }
    if start > end || end > x.dim(dim) {
        return Err(format!(
            "range {start}..{end} out of bounds for dim {dim} of size {} (input {x})",
            x.dim(dim)
        ));
    }
    let mut r = Rules::new(mode, [x.with_dim(dim, end - start)]);
    for i in (0..x.ndim()).filter(|&i| i != dim) {
        r.push(&[Sbp::S(i)], &[Sbp::S(i)]);
    }
    r.push(&[Sbp::Broadcast], &[Sbp::Broadcast]);
    for m in PARTIALS {
        r.push(&[m], &[m]);
    }
    Ok(r)
}
