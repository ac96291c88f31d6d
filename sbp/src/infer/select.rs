//! Candidate tables of element-wise selection: where (a condition picks between two values),
//! masked fill (a mask replaces values by a constant), and the position-dependent element-wise
//! ops (triangular masks, rotary embedding) whose local kernels read their global offsets.

use super::elementwise::{broadcast_shape, split_through};
use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// where(cond, a, b), all three broadcasting: S(o) of the output maps to each operand's
/// matching dim (size-1 or missing dims take B); B->B; (B, P, P)->P (linear in the values).
pub fn where_cond(cond: &Shape, a: &Shape, b: &Shape, mode: RuleMode) -> Result<Rules, String> {
    let out = broadcast_shape(cond, a)
        .and_then(|s| broadcast_shape(&s, b))
        .ok_or_else(|| format!("shapes {cond}, {a} and {b} do not broadcast"))?;
    let mut r = Rules::new(mode, [out.clone()]);
    for o in 0..out.ndim() {
        r.push(
            &[
                split_through(cond, &out, o),
                split_through(a, &out, o),
                split_through(b, &out, o),
            ],
            &[Sbp::S(o)],
        );
    }
    r.push(&[B, B, B], &[B]);
    r.push(&[B, P, P], &[P]);
    Ok(r)
}

/// masked_fill(x, mask): x keeps its shape, the mask broadcasts to it. S(i) -> S(i) with the
/// mask's matching dim (or B); B->B; (P, B)->P only when the fill value is 0 (`linear`).
pub fn masked_fill(x: &Shape, mask: &Shape, linear: bool, mode: RuleMode) -> Result<Rules, String> {
    if broadcast_shape(x, mask).as_ref() != Some(x) {
        return Err(format!("mask {mask} does not broadcast to the input {x}"));
    }
    let mut r = Rules::new(mode, [x.clone()]);
    for i in 0..x.ndim() {
        r.push(&[Sbp::S(i), split_through(mask, x, i)], &[Sbp::S(i)]);
    }
    r.push(&[B, B], &[B]);
    if linear {
        r.push(&[P, B], &[P]);
    }
    Ok(r)
}

/// A linear element-wise op whose value depends on global positions (the kernel takes its
/// region's offsets): any split of a dim not in `whole_dims` stays; B->B; P->P.
pub fn positional(x: &Shape, whole_dims: &[usize], mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [x.clone()]);
    for i in (0..x.ndim()).filter(|i| !whole_dims.contains(i)) {
        r.push(&[Sbp::S(i)], &[Sbp::S(i)]);
    }
    r.push(&[B], &[B]);
    r.push(&[P], &[P]);
    r
}
