//! Candidate tables of layer normalisation (output, and the per-row mean and 1/std it saves)
//! and of its input gradient from those statistics, and of RMS normalisation (output; input
//! gradient beside the per-element weight-gradient terms).

use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// Checks x against the normalised-shape parameter `w`; returns the number of leading dims.
fn check(k: usize, x: &Shape, w: &Shape) -> Result<usize, String> {
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
    Ok(lead)
}

fn must_be(what: &str, got: &Shape, want: &Shape) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what} must be {want}, got {got}"))
    }
}

/// The shape of the per-row statistics of `x` normalised over its last `k` dims: `x`'s shape
/// with those dims 1.
pub fn stats_shape(k: usize, x: &Shape) -> Shape {
    let lead = x.ndim().saturating_sub(k);
    Shape::new(
        x.dims()
            .iter()
            .enumerate()
            .map(|(i, &d)| if i < lead { d } else { 1 }),
    )
}

/// (x, weight, bias) -> (y, mean, rstd), mean and rstd of `stats_shape`:
/// (S(i), B, B) -> (S(i), S(i), S(i)) for a leading (not normalised) dim i; (B, B, B) -> B.
pub fn forward(k: usize, xs: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    let lead = check(k, xs[0], xs[1])?;
    must_be("bias", xs[2], xs[1])?;
    let stats = stats_shape(k, xs[0]);
    let mut r = Rules::new(mode, [xs[0].clone(), stats.clone(), stats]);
    for i in 0..lead {
        r.push(&[Sbp::S(i), B, B], &[Sbp::S(i); 3]);
    }
    r.push(&[B, B, B], &[B, B, B]);
    Ok(r)
}

/// (x, weight, dy, mean, rstd) -> dx: (S(i), B, S(i), S(i), S(i)) -> S(i); (B, B, P, B, B) -> P
/// (linear in dy); (B, B, B, B, B) -> B.
pub fn backward(k: usize, xs: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    if xs.len() != 5 {
        return Err(format!(
            "takes x, weight, dy, mean and rstd, got {} inputs",
            xs.len()
        ));
    }
    let lead = check(k, xs[0], xs[1])?;
    must_be("dy", xs[2], xs[0])?;
    let stats = stats_shape(k, xs[0]);
    must_be("mean", xs[3], &stats)?;
    must_be("rstd", xs[4], &stats)?;
    let mut r = Rules::new(mode, [xs[0].clone()]);
    for i in 0..lead {
        r.push(
            &[Sbp::S(i), B, Sbp::S(i), Sbp::S(i), Sbp::S(i)],
            &[Sbp::S(i)],
        );
    }
    r.push(&[B, B, P, B, B], &[P]);
    r.push(&[B; 5], &[B]);
    Ok(r)
}

/// (x, weight) -> y, RMS-normalised over the last dim: (S(i), B) -> S(i) for a leading dim i;
/// (B, B) -> B.
pub fn rms_norm(x: &Shape, w: &Shape, mode: RuleMode) -> Result<Rules, String> {
    let lead = check(1, x, w)?;
    let mut r = Rules::new(mode, [x.clone()]);
    for i in 0..lead {
        r.push(&[Sbp::S(i), B], &[Sbp::S(i)]);
    }
    r.push(&[B, B], &[B]);
    Ok(r)
}

/// (x, weight, dy) -> (dx, dy * xhat), both of x's shape: (S(i), B, S(i)) -> (S(i), S(i));
/// (B, B, P) -> (P, P) (both linear in dy); (B, B, B) -> (B, B).
pub fn rms_norm_backward(xs: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    let [x, w, dy] = xs else {
        return Err(format!("takes x, weight and dy, got {} inputs", xs.len()));
    };
    let lead = check(1, x, w)?;
    must_be("dy", dy, x)?;
    let mut r = Rules::new(mode, [(*x).clone(), (*x).clone()]);
    for i in 0..lead {
        r.push(&[Sbp::S(i), B, Sbp::S(i)], &[Sbp::S(i), Sbp::S(i)]);
    }
    r.push(&[B, B, P], &[P, P]);
    r.push(&[B, B, B], &[B, B]);
    Ok(r)
}

/// The residual add fused with layer normalisation (x, residual branch, weight, bias) ->
/// (r = x + branch, y, mean, rstd): rows split alike on a leading dim with the parameters
/// broadcast, or everything whole; never P (not linear).
pub fn residual_layer_norm(x: &Shape, stats: &Shape, mode: RuleMode) -> Rules {
    let outs = [x.clone(), x.clone(), stats.clone(), stats.clone()];
    let mut r = Rules::new(mode, outs);
    for i in 0..x.ndim().saturating_sub(1) {
        r.push(&[Sbp::S(i), Sbp::S(i), B, B], &[Sbp::S(i); 4]);
    }
    r.push(&[B; 4], &[B; 4]);
    r
}

/// Its backward (r, weight, mean, rstd, dy (, dr)) -> (dr_in, dweight, dbias), `n_in` inputs:
/// rows split -> the parameter gradients partial sums over the row shards; linear in (dy, dr)
/// given r and the statistics; all whole.
pub fn residual_layer_norm_backward(x: &Shape, w: &Shape, n_in: usize, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [x.clone(), w.clone(), w.clone()]);
    for i in 0..x.ndim().saturating_sub(1) {
        let mut ins = vec![Sbp::S(i); n_in];
        ins[1] = B;
        r.push(&ins, &[Sbp::S(i), P, P]);
    }
    let mut ins = vec![B; n_in];
    ins.iter_mut().skip(4).for_each(|t| *t = P);
    r.push(&ins, &[P; 3]);
    r.push(&vec![B; n_in], &[B; 3]);
    r
}
