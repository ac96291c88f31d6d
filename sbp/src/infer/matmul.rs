//! Candidate tables of matmul and batch matmul.

use super::Rules;
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// `a [m, k] @ b [k, n]`: (S(0),B)->S(0); (B,S(1))->S(1); (S(1),S(0))->P; (P,B)->P; (B,P)->P;
/// (B,B)->B.
pub(super) fn matmul(a: &Shape, b: &Shape) -> Result<Rules, String> {
    if a.ndim() != 2 || b.ndim() != 2 || a.dim(1) != b.dim(0) {
        return Err(format!("needs a [m, k] and b [k, n], got a {a} and b {b}"));
    }
    let mut r = Rules::new(vec![Shape::from([a.dim(0), b.dim(1)])]);
    push_matmul(&mut r, 0);
    Ok(r)
}

/// `a [..batch, m, k] @ b [..batch, k, n]`: S(batch) on both -> S(batch), then the matmul
/// table on the last two dims.
pub(super) fn batch_matmul(a: &Shape, b: &Shape) -> Result<Rules, String> {
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
    let mut r = Rules::new(vec![Shape::new(dims)]);
    for i in 0..n - 2 {
        r.push(&[Sbp::S(i), Sbp::S(i)], &[Sbp::S(i)]);
    }
    push_matmul(&mut r, n - 2);
    Ok(r)
}

/// The 2-d matmul table on dims `m = base`, `k`/`n = base + 1` of both operands.
fn push_matmul(r: &mut Rules, base: usize) {
    let (d0, d1) = (Sbp::S(base), Sbp::S(base + 1));
    r.push(&[d0, B], &[d0]);
    r.push(&[B, d1], &[d1]);
    r.push(&[d1, d0], &[P]);
    r.push(&[P, B], &[P]);
    r.push(&[B, P], &[P]);
    r.push(&[B, B], &[B]);
}
