//! The global L2 norm of gradients in any layout, and the clipping factor it gives. Each
//! gradient's sum of squares is a global 0-d tensor (the engine boxes split, partial and sharded
//! pieces as the ops need), the sums on one placement are added there, and each placement's
//! total moves to the union of the placements' ranks (pipeline stages are disjoint placements)
//! to be added once more, so every rank reads the same norm. Nothing here assumes a layout.

use oxiflow_collectives::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::{no_grad, Tensor};

use crate::{Result, TensorError};

/// torch's `clip_grad_norm_` guard against a zero norm.
const CLIP_EPS: f64 = 1e-6;

fn norm_err(detail: String) -> TensorError {
    TensorError::Kernel {
        op: "global_grad_norm",
        detail,
    }
}

/// sqrt(sum over `grads` of the sum of their squared elements), on every rank: one value for
/// the gradients whatever their layouts (local tensors count on every rank as they are).
/// Every rank must call it with the same list.
pub fn global_grad_norm(grads: &[Tensor]) -> Result<f64> {
    let _ng = no_grad();
    let mut local = 0.0;
    // One running total per placement, in first-seen order (the same on every rank).
    let mut totals: Vec<(Placement, Tensor)> = Vec::new();
    for g in grads {
        let sq = g.square()?.sum_all()?.cast(DType::F64)?;
        let Some(p) = sq.placement().cloned() else {
            local += scalar(&sq)?;
            continue;
        };
        match totals.iter_mut().find(|(q, _)| *q == p) {
            Some((_, t)) => *t = t.add(&sq)?,
            None => totals.push((p, sq)),
        }
    }
    let sum = match totals.as_slice() {
        [] => local,
        [(p, t)] => local + scalar(&t.to_global(p, NdSbp::broadcast(p.ndim()))?)?,
        many => {
            let union = union_of(many.iter().map(|(p, _)| p))?;
            let mut all: Option<Tensor> = None;
            for (_, t) in many {
                let t = t.to_global(&union, NdSbp::broadcast(1))?;
                all = Some(match all {
                    Some(a) => a.add(&t)?,
                    None => t,
                });
            }
            local + all.map_or(Ok(0.0), |a| scalar(&a))?
        }
    };
    Ok(sum.max(0.0).sqrt())
}

/// The factor gradients are multiplied by when their norm `norm` is clipped to `max_norm`
/// (as torch: `max_norm / (norm + 1e-6)` when that is below 1, else 1; a non-finite norm gives
/// NaN, as torch's clipped gradients are then, so the step shows it).
pub fn clip_factor(norm: f64, max_norm: Option<f64>) -> f64 {
    match max_norm {
        Some(_) if !norm.is_finite() => f64::NAN,
        Some(m) => (m / (norm + CLIP_EPS)).min(1.0),
        None => 1.0,
    }
}

/// The value of a one-element tensor (every rank of its placement gets it).
fn scalar(t: &Tensor) -> Result<f64> {
    t.to_vec::<f64>()?
        .first()
        .copied()
        .ok_or_else(|| norm_err(format!("empty sum of squares {}", t.describe())))
}

/// A 1-d placement over every rank of `places` (sorted), on their device type.
fn union_of<'a>(places: impl Iterator<Item = &'a Placement>) -> Result<Placement> {
    let mut ranks = Vec::new();
    let mut device = None;
    for p in places {
        if device.is_some_and(|d| d != p.device()) {
            return Err(norm_err(format!(
                "gradients on {p} and on another device type: no placement holds both"
            )));
        }
        device = Some(p.device());
        ranks.extend_from_slice(p.ranks());
    }
    ranks.sort_unstable();
    ranks.dedup();
    let device = device.ok_or_else(|| norm_err("no placement".into()))?;
    Placement::new_1d(device, ranks).map_err(|e| norm_err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clip_factor_is_torchs() {
        assert_eq!(clip_factor(3.0, None), 1.0);
        assert_eq!(clip_factor(0.5, Some(1.0)), 1.0);
        let f = clip_factor(4.0, Some(1.0));
        assert!((f - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
        assert!(clip_factor(f64::NAN, Some(1.0)).is_nan());
        assert!(clip_factor(f64::INFINITY, Some(1.0)).is_nan());
        assert_eq!(clip_factor(f64::INFINITY, None), 1.0);
    }

    #[test]
    fn local_gradients_give_the_plain_norm() {
        let a = Tensor::from_vec(vec![3.0f32, 0.0], [2]).unwrap();
        let b = Tensor::from_vec(vec![4.0f64], [1, 1]).unwrap();
        let n = global_grad_norm(&[a, b]).unwrap();
        assert!((n - 5.0).abs() < 1e-12, "{n}");
        assert_eq!(global_grad_norm(&[]).unwrap(), 0.0);
    }
}
