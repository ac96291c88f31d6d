//! Candidate tables of layer normalisation and its backward.

use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// Checks x against the normalised-shape parameter and returns the number of leading dims.
fn check(
    k: usize,
    x: &Shape,
    w: &Shape,
    second: &Shape,
    second_name: &str,
) -> Result<usize, String> {
    if k == 0 || k > x.ndim() {
        return Err(format!(
            "normalized_dims {k} must be in 1..={} for input {x}",
            x.ndim()
        ));
    }
    let lead = x.ndim() - k;
    if w.dims() != &x.dims()[lead..] {
        return Err(format!(
            "weight {w} must equal the last {k} dims of input {x}"
        ));
    }
    let want: &[usize] = if second_name == "dy" {
        x.dims()
    } else {
        w.dims()
    };
    if second.dims() != want {
        return Err(format!(
            "{second_name} {second} does not match input {x} / weight {w}"
        ));
    }
    Ok(lead)
}

/// (x, weight, bias) -> y: (S(i), B, B)->S(i) for a leading (not normalised) dim i;
/// (B, B, B)->B.
pub fn forward(k: usize, xs: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    let lead = check(k, xs[0], xs[1], xs[2], "bias")?;
    let mut r = Rules::new(mode, [xs[0].clone()]);
    for i in 0..lead {
        r.push(&[Sbp::S(i), B, B], &[Sbp::S(i)]);
    }
    r.push(&[B, B, B], &[B]);
    Ok(r)
}

/// (x, weight, dy) -> (dx, dweight, dbias): (S(i), B, S(i))->(S(i), P, P); (B, B, P)->(P, P, P)
/// (all three are linear in dy); (B, B, B)->(B, B, B).
pub fn backward(k: usize, xs: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    let lead = check(k, xs[0], xs[1], xs[2], "dy")?;
    let mut r = Rules::new(mode, [xs[0].clone(), xs[1].clone(), xs[1].clone()]);
    for i in 0..lead {
        r.push(&[Sbp::S(i), B, Sbp::S(i)], &[Sbp::S(i), P, P]);
    }
    r.push(&[B, B, P], &[P, P, P]);
    r.push(&[B, B, B], &[B, B, B]);
    Ok(r)
}
