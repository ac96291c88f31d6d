//! The global L2 norm of gradients in any layout, and the clipping factor it gives. Each
//! gradient's sum of squares is a global 0-d tensor (the engine boxes split, partial and sharded
//! pieces as the ops need), the sums on one placement are added there, and each placement's
//! total moves to the union of the placements' ranks (pipeline stages are disjoint placements)
//! to be added once more, so every rank reads the same norm. The same sums find the first
//! tensor holding a NaN or infinity (`first_non_finite`). Nothing here assumes a layout.

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
/// Every rank must call it with the same list. A NaN or infinity anywhere gives a norm that
/// is not finite.
pub fn global_grad_norm(grads: &[Tensor]) -> Result<f64> {
    let _ng = no_grad();
    let squares = grads
        .iter()
        .map(|g| g.square()?.sum_all()?.cast(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    let sum = global_sum(&squares)?;
    // A sum of squares is never negative; `max` would turn a NaN into 0.
    Ok(if sum.is_nan() {
        sum
    } else {
        sum.max(0.0).sqrt()
    })
}

/// The index of the first of `tensors` that holds a NaN or an infinity, the same on every rank
/// (every rank must call it with the same list, in any layouts). Each tensor counts as the sum
/// of its elements times 0, which is NaN exactly when one of them is not finite: one global
/// sum over all of them first, and only when that is NaN one per tensor, in order, each moved
/// to every rank of their placements.
pub fn first_non_finite(tensors: &[Tensor]) -> Result<Option<usize>> {
    let _ng = no_grad();
    let flags = tensors
        .iter()
        .map(|t| t.mul_scalar(0.0)?.sum_all()?.cast(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    if global_sum(&flags)?.is_finite() {
        return Ok(None);
    }
    // Each flag moves to every rank of any of them, so every rank reads every flag (pipeline
    // stages hold disjoint parts).
    let places: Vec<&Placement> = flags.iter().filter_map(Tensor::placement).collect();
    let union = match places.is_empty() {
        true => None,
        false => Some(union_of(places.into_iter())?),
    };
    for (i, f) in flags.iter().enumerate() {
        let v = match (&union, f.placement()) {
            (Some(u), Some(_)) => scalar(&f.to_global(u, NdSbp::broadcast(1))?)?,
            _ => scalar(f)?,
        };
        if !v.is_finite() {
            return Ok(Some(i));
        }
    }
    Ok(None)
}

/// The sum of 0-d f64 `parts` (global on any placements, or local), on every rank.
fn global_sum(parts: &[Tensor]) -> Result<f64> {
    let mut local = 0.0;
    // One running total per placement, in first-seen order (the same on every rank).
    let mut totals: Vec<(Placement, Tensor)> = Vec::new();
    for part in parts {
        let Some(p) = part.placement().cloned() else {
            local += scalar(part)?;
            continue;
        };
        match totals.iter_mut().find(|(q, _)| *q == p) {
            Some((_, t)) => *t = t.add(part)?,
            None => totals.push((p, part.clone())),
        }
    }
    Ok(match totals.as_slice() {
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
    })
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

    #[test]
    fn a_nan_or_infinity_makes_the_norm_non_finite_and_is_found() {
        let ok = Tensor::from_vec(vec![3.0f32, 4.0], [2]).unwrap();
        let nan = Tensor::from_vec(vec![1.0f32, f32::NAN], [2]).unwrap();
        let inf = Tensor::from_vec(vec![f64::NEG_INFINITY], [1]).unwrap();
        assert!(global_grad_norm(&[ok.clone(), nan.clone()])
            .unwrap()
            .is_nan());
        assert_eq!(
            global_grad_norm(std::slice::from_ref(&inf)).unwrap(),
            f64::INFINITY
        );
        assert_eq!(first_non_finite(std::slice::from_ref(&ok)).unwrap(), None);
        assert_eq!(first_non_finite(&[ok.clone(), inf, nan]).unwrap(), Some(1));
        // Finite values whose squares overflow f32 are finite.
        let big = Tensor::from_vec(vec![3e38f32], [1]).unwrap();
        assert_eq!(first_non_finite(&[ok, big]).unwrap(), None);
    }
}
