//! Candidate tables of matmul and batch matmul.

use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// `a [.., m, k] @ b [k, n] -> [.., m, n]`: (S(i), B)->S(i) for every dim i of `a` but k;
/// (B, S(1))->S(last); (S(last), S(0))->P; (P,B)->P; (B,P)->P; (B,B)->B.
pub fn matmul(a: &Shape, b: &Shape, mode: RuleMode) -> Result<Rules, String> {
    if a.ndim() < 1 || b.ndim() != 2 || a.dim(a.ndim() - 1) != b.dim(0) {
        return Err(format!("needs a [.., k] and b [k, n], got a {a} and b {b}"));
    }
    let last = a.ndim() - 1;
    let mut r = Rules::new(mode, [a.with_dim(last, b.dim(1))]);
    for i in 0..last.saturating_sub(1) {
        r.push(&[Sbp::S(i), B], &[Sbp::S(i)]);
    }
    if last == 0 {
        // a [k]: only the contraction and the columns of b can be split.
        r.push(&[B, Sbp::S(1)], &[Sbp::S(0)]);
        r.push(&[Sbp::S(0), Sbp::S(0)], &[P]);
        r.push(&[P, B], &[P]);
        r.push(&[B, P], &[P]);
        r.push(&[B, B], &[B]);
    } else {
        push_matmul(&mut r, last - 1, 0);
    }
    Ok(r)
}

/// `a [..batch, m, k] @ b [..batch, k, n]`: S(batch) on both -> S(batch), then the matmul
/// table on the last two dims.
pub fn batch_matmul(a: &Shape, b: &Shape, mode: RuleMode) -> Result<Rules, String> {
    let n = a.ndim();
    if n < 2
        || b.ndim() != n
        || a.dims()[..n - 2] != b.dims()[..n - 2]
        || a.dim(n - 1) != b.dim(n - 2)
    {
        return Err(format!(
            "needs a [..batch, m, k] and b [..batch, k, n] with equal batch dims, got a {a} and b {b}"
        ));
    }
    let mut dims = a.dims()[..n - 2].to_vec();
    dims.push(a.dim(n - 2));
    dims.push(b.dim(n - 1));
    let mut r = Rules::new(mode, [Shape::new(dims)]);
    for i in 0..n - 2 {
        r.push(&[Sbp::S(i), Sbp::S(i)], &[Sbp::S(i)]);
    }
    push_matmul(&mut r, n - 2, n - 2);
    Ok(r)
}

/// The 2-d matmul table on dims `m = base`, `k = base + 1` of `a` and `k`/`n` of `b` (its last
/// two dims), the output's `m`/`n` at `base`/`base + 1`.
fn push_matmul(r: &mut Rules, base: usize, b_base: usize) {
    let (d0, d1) = (Sbp::S(base), Sbp::S(base + 1));
    let (bk, bn) = (Sbp::S(b_base), Sbp::S(b_base + 1));
    r.push(&[d0, B], &[d0]);
    r.push(&[B, bn], &[d1]);
    r.push(&[d1, bk], &[P]);
    r.push(&[P, B], &[P]);
    r.push(&[B, P], &[P]);
    r.push(&[B, B], &[B]);
}

/// `op(a) @ op(b)`, either operand's last two dims transposed (`ta`, `tb`): batched (`a` and
/// `b` of one rank >= 2 with equal batch dims) or not (`b` 2-d, `a [.., m, k]`, or `a [k, m]`
/// 2-d when transposed). The candidates are matmul's with each split moved to the dim it
/// names in the stored operand.
pub fn matmul_t(
    a: &Shape,
    b: &Shape,
    (ta, tb): (bool, bool),
    batched: bool,
    mode: RuleMode,
) -> Result<Rules, String> {
    let n = a.ndim();
    let fits = if batched {
        n >= 2 && b.ndim() == n && a.dims()[..n - 2] == b.dims()[..n - 2]
    } else {
        b.ndim() == 2 && n >= 2 && (!ta || n == 2)
    };
    let err = || {
        format!(
            "needs op(a) [.., m, k] and op(b) [k, n] (transposed: a {ta}, b {tb}; batched {batched}), got a {a} and b {b}"
        )
    };
    if !fits {
        return Err(err());
    }
    let base = n - 2;
    let b_base = if batched { base } else { 0 };
    let (a_m, a_k) = if ta {
        (base + 1, base)
    } else {
        (base, base + 1)
    };
    let (b_k, b_n) = if tb {
        (b_base + 1, b_base)
    } else {
        (b_base, b_base + 1)
    };
    if a.dim(a_k) != b.dim(b_k) {
        return Err(err());
    }
    let mut dims = a.dims()[..base].to_vec();
    dims.push(a.dim(a_m));
    dims.push(b.dim(b_n));
    let mut r = Rules::new(mode, [Shape::new(dims)]);
    for i in 0..base {
        if batched {
            r.push(&[Sbp::S(i), Sbp::S(i)], &[Sbp::S(i)]);
        } else {
            r.push(&[Sbp::S(i), B], &[Sbp::S(i)]);
        }
    }
    r.push(&[Sbp::S(a_m), B], &[Sbp::S(base)]);
    r.push(&[B, Sbp::S(b_n)], &[Sbp::S(base + 1)]);
    r.push(&[Sbp::S(a_k), Sbp::S(b_k)], &[P]);
    r.push(&[P, B], &[P]);
    r.push(&[B, P], &[P]);
    r.push(&[B, B], &[B]);
    Ok(r)
}
