//! Candidate tables of softmax / log-softmax and their backward ops.

use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// Over `dim`: S(i != dim)->S(i); B->B.
pub fn forward(dim: usize, x: &Shape, mode: RuleMode) -> Result<Rules, String> {
    if dim >= x.ndim() {
        return Err(format!("dim {dim} out of range for input {x}"));
    }
    let mut r = Rules::new(mode, [x.clone()]);
    for i in (0..x.ndim()).filter(|&i| i != dim) {
        r.push(&[Sbp::S(i)], &[Sbp::S(i)]);
    }
    r.push(&[B], &[B]);
    Ok(r)
}

/// Inputs (y, dy): S(i != dim) on both -> S(i); B,B->B; (B, P)->P (dx is linear in dy).
pub fn backward(dim: usize, y: &Shape, dy: &Shape, mode: RuleMode) -> Result<Rules, String> {
    if y != dy {
        return Err(format!("y {y} and dy {dy} must have the same shape"));
    }
    if dim >= y.ndim() {
        return Err(format!("dim {dim} out of range for input {y}"));
    }
    let mut r = Rules::new(mode, [y.clone()]);
    for i in (0..y.ndim()).filter(|&i| i != dim) {
        r.push(&[Sbp::S(i), Sbp::S(i)], &[Sbp::S(i)]);
    }
    r.push(&[B, B], &[B]);
    r.push(&[B, P], &[P]);
    Ok(r)
}
