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

/// Rows written into n caches along `dim` (inputs: the caches, then their rows, each shaped as
/// its cache but along `dim`) -> the n caches: a split of any other dim on every operand, the
/// caches split on `dim` beside whole rows (each rank writes the rows that fall in its part),
/// or all whole.
pub fn write_rows(dim: usize, xs: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    let n = xs.len() / 2;
    if n == 0 || xs.len() != 2 * n {
        return Err(format!(
            "needs caches and as many row blocks, got {} operands",
            xs.len()
        ));
    }
    let (caches, rows) = xs.split_at(n);
    for (c, r) in caches.iter().zip(rows) {
        let fits = dim < c.ndim()
            && r.ndim() == c.ndim()
            && (0..c.ndim()).all(|i| i == dim || r.dim(i) == c.dim(i));
        if !fits {
            return Err(format!("rows {r} do not fit cache {c} outside dim {dim}"));
        }
    }
    let nd = caches[0].ndim();
    if caches.iter().any(|c| c.ndim() != nd) {
        return Err("every cache must have the same number of dims".into());
    }
    let mut r = Rules::new(mode, caches.iter().map(|c| (*c).clone()));
    for i in (0..nd).filter(|&i| i != dim) {
        r.push_uniform(2 * n, n, Sbp::S(i));
    }
    r.push_uniform(2 * n, n, Sbp::B);
    // A split of `dim` cuts caches of one length alike, so the rows land alike in each.
    if caches.iter().any(|c| c.dim(dim) != caches[0].dim(dim)) {
        return Ok(r);
    }
    let split: Vec<Sbp> = std::iter::repeat_n(Sbp::S(dim), n)
        .chain(std::iter::repeat_n(Sbp::B, n))
        .collect();
    r.push(&split, &split[..n]);
    Ok(r)
}
