//! Candidate tables of embedding lookup and its backward (scatter-add into the weight).

use super::gather::push_partial_reads;
use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// (ids [..r], weight [V, D]) -> [..r, D]: (S(i), B)->S(i); (B, S(1))->S(r); (B, S(0))->P (a
/// vocabulary split: each rank looks up the ids inside its rows, offset from the op's local
/// attributes, and gives zero rows for the others); (B, P(op))->P(op); (B, B)->B.
pub fn forward(ids: &Shape, weight: &Shape, mode: RuleMode) -> Result<Rules, String> {
    if weight.ndim() != 2 {
        return Err(format!("weight must be [V, D], got {weight} (ids {ids})"));
    }
    let rk = ids.ndim();
    let mut dims = ids.to_vec();
    dims.push(weight.dim(1));
    let mut r = Rules::new(mode, [Shape::new(dims)]);
    for i in 0..rk {
        r.push(&[Sbp::S(i), B], &[Sbp::S(i)]);
    }
    r.push(&[B, Sbp::S(1)], &[Sbp::S(rk)]);
    push_partial_reads(&mut r, 0, |w| [B, w]);
    Ok(r)
}

/// (ids [..r], dy [..r, D]) -> dweight [V, D]: (S(i), S(i))->P (each rank scatter-adds its
/// rows); (B, S(r))->S(1); (B, P)->P; (B, B)->B; (B, B)->S(0) (each rank fills its vocabulary
/// rows). `vocab_split` (the weight is split on the vocabulary) lists (B, B)->S(0) first and
/// leaves out (B, P)->P, so a partial dy is reduced (its size) rather than dweight.
pub fn backward(
    num_embeddings: usize,
    ids: &Shape,
    dy: &Shape,
    vocab_split: bool,
    mode: RuleMode,
) -> Result<Rules, String> {
    let rk = ids.ndim();
    if dy.ndim() != rk + 1 || dy.dims()[..rk] != *ids.dims() {
        return Err(format!(
            "dy must be ids' shape plus [D]: ids {ids}, dy {dy}"
        ));
    }
    let mut r = Rules::new(mode, [Shape::from([num_embeddings, dy.dim(rk)])]);
    if vocab_split {
        r.push(&[B, B], &[Sbp::S(0)]);
    }
    for i in 0..rk {
        r.push(&[Sbp::S(i), Sbp::S(i)], &[P]);
    }
    r.push(&[B, Sbp::S(rk)], &[Sbp::S(1)]);
    if !vocab_split {
        r.push(&[B, P], &[P]);
    }
    r.push(&[B, B], &[B]);
    r.push(&[B, B], &[Sbp::S(0)]);
    Ok(r)
}
