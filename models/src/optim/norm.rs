//! The global L2 norm of gradients in any layout, and the clipping factor it gives. The
//! gradients are grouped by what lets one multi-tensor sum of squares serve them without
//! boxing (`oxiflow_ops::sum_squares`: one op per group, all f64): global ones by placement
//! and, per mesh axis, split or not; local ones by device. Each group's total is a 0-d tensor,
//! partial over the axes its tensors are split on; it is made broadcast on its placement, the
//! totals of one placement are added there, and each placement's sum moves to the union of the
//! placements' ranks (pipeline stages are disjoint placements) to be added once more, so every
//! rank reads the same norm. Everything is queued before anything is read ([`QueuedSum`]), so
//! a caller can read the norm together with other results in one host synchronisation. The
//! same pass in its `x * 0` form finds the first tensor holding a NaN or an infinity
//! (`first_non_finite`). Nothing here assumes a layout.

use oxiflow_dtype::DType;
use oxiflow_ops::sum_squares::{non_finite_sums, sum_squares_multi, TensorSums};
use oxiflow_placement::Placement;
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{no_grad, Device, Tensor};

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
    Ok(norm_of(queue_sum_of_squares(grads)?.read()?))
}

/// The L2 norm of a sum of squares `sum` (NaN stays NaN).
pub fn norm_of(sum: f64) -> f64 {
    // A sum of squares is never negative; `max` would turn a NaN into 0.
    if sum.is_nan() {
        sum
    } else {
        sum.max(0.0).sqrt()
    }
}

/// A sum over tensors queued on their devices and not read yet: the sum of its parts, 0-d
/// f64 tensors: one broadcast over the union of the global tensors' placements (first, when
/// there are global tensors), then one local tensor per device of the local ones.
#[derive(Clone, Debug, Default)]
pub struct QueuedSum {
    parts: Vec<Tensor>,
}

impl QueuedSum {
    /// The parts, whose values add up to the sum (a caller may read them together with other
    /// results, in one transfer where they share a placement).
    pub fn parts(&self) -> &[Tensor] {
        &self.parts
    }
    /// The sum (every rank reads the same value).
    pub fn read(&self) -> Result<f64> {
        let mut sum = 0.0;
        for t in &self.parts {
            sum += scalar(t)?;
        }
        Ok(sum)
    }
}

/// The sum over `grads` of their squared elements, queued (see [`QueuedSum`]); every rank
/// must call it with the same list.
pub fn queue_sum_of_squares(grads: &[Tensor]) -> Result<QueuedSum> {
    let _ng = no_grad();
    let groups = groups(grads);
    let mut totals = Vec::with_capacity(groups.len());
    for g in &groups {
        let members: Vec<&Tensor> = g.iter().map(|&i| &grads[i]).collect();
        totals.push(broadcast(sum_squares_multi(&members)?.total)?);
    }
    queue_sum(&totals)
}

/// The index of the first of `tensors` that holds a NaN or an infinity, the same on every rank
/// (every rank must call it with the same list, in any layouts). Each tensor counts as the sum
/// of its elements times 0, which is NaN exactly when one of them is not finite: one
/// multi-tensor pass per group, each group's per-tensor sums moved to every rank of any of
/// them (pipeline stages hold disjoint parts) and read.
pub fn first_non_finite(tensors: &[Tensor]) -> Result<Option<usize>> {
    let _ng = no_grad();
    let groups = groups(tensors);
    let mut flags: Vec<(Vec<usize>, Tensor)> = Vec::with_capacity(groups.len());
    for g in groups {
        let members: Vec<&Tensor> = g.iter().map(|&i| &tensors[i]).collect();
        let TensorSums { each, .. } = non_finite_sums(&members)?;
        flags.push((g, broadcast(each)?));
    }
    let places: Vec<&Placement> = flags.iter().filter_map(|(_, f)| f.placement()).collect();
    let union = match places.is_empty() {
        true => None,
        false => Some(union_of(places.into_iter())?),
    };
    let mut first: Option<usize> = None;
    for (members, f) in &flags {
        let f = match (&union, f.placement()) {
            (Some(u), Some(p)) if u != p => f.to_global(u, NdSbp::broadcast(1))?,
            _ => f.clone(),
        };
        let values = f.to_vec::<f64>()?;
        if let Some(k) = values.iter().position(|v| !v.is_finite()) {
            let i = members.get(k).copied().ok_or_else(|| {
                norm_err(format!(
                    "{} flags for {} tensors",
                    values.len(),
                    members.len()
                ))
            })?;
            first = Some(first.map_or(i, |j| j.min(i)));
        }
    }
    Ok(first)
}

/// What lets one multi-tensor sum serve several tensors with no boxing but of partial sums.
#[derive(PartialEq)]
enum GroupKey {
    /// Local tensors on one device.
    Local(Device),
    /// Global tensors on one placement, split (true) or not on each mesh axis.
    Global(Placement, Vec<bool>),
}

/// A split over a mesh axis of one rank holds the whole tensor: it counts as not split.
fn key_of(t: &Tensor) -> GroupKey {
    match (t.placement(), t.nd_sbp()) {
        (Some(p), Some(nd)) => GroupKey::Global(
            p.clone(),
            nd.iter()
                .zip(p.shape())
                .map(|(s, &n)| n > 1 && matches!(s, Sbp::Split(_)))
                .collect(),
        ),
        _ => GroupKey::Local(t.device()),
    }
}

/// The indices of `tensors` in groups of one [`GroupKey`], groups in first-seen order (the
/// same on every rank), indices ascending in each.
fn groups(tensors: &[Tensor]) -> Vec<Vec<usize>> {
    let mut keys: Vec<GroupKey> = Vec::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let k = key_of(t);
        match keys.iter().position(|q| *q == k) {
            Some(j) => members[j].push(i),
            None => {
                keys.push(k);
                members.push(vec![i]);
            }
        }
    }
    members
}

/// A global result made broadcast on its placement (a local one as it is).
fn broadcast(t: Tensor) -> Result<Tensor> {
    match t.placement().cloned() {
        Some(p) if t.nd_sbp().is_some_and(|nd| !nd.is_all_broadcast()) => {
            Ok(t.to_global(&p, NdSbp::broadcast(p.ndim()))?)
        }
        _ => Ok(t),
    }
}

/// The sum of 0-d f64 `parts` (global broadcast on any placements, or local), queued.
fn queue_sum(parts: &[Tensor]) -> Result<QueuedSum> {
    let mut local: Vec<Tensor> = Vec::new();
    // One running total per placement, in first-seen order (the same on every rank).
    let mut totals: Vec<(Placement, Tensor)> = Vec::new();
    for part in parts {
        let Some(p) = part.placement().cloned() else {
            match local.iter_mut().find(|t| t.device() == part.device()) {
                Some(t) => *t = t.add(part)?,
                None => local.push(part.clone()),
            }
            continue;
        };
        match totals.iter_mut().find(|(q, _)| *q == p) {
            Some((_, t)) => *t = t.add(part)?,
            None => totals.push((p, part.clone())),
        }
    }
    let global = match totals.as_slice() {
        [] => None,
        [(_, t)] => Some(t.clone()),
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
            all
        }
    };
    Ok(QueuedSum {
        parts: global.into_iter().chain(local).collect(),
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

/// The clip ratio `max_norm / (norm + eps)` of the queued sum of squares `sum`, as a 0-d f64
/// tensor computed on its device with nothing read on the host: what a clipped update
/// scales its gradients by `min(ratio, 1)` with ([`Optimizer::queue_apply`]). For a finite
/// norm `min(ratio, 1)` is `clip_factor(norm_of(sum.read()), Some(max_norm))` bit for bit (the
/// same f64 operations); a non-finite sum makes the ratio NaN (it adds `sum * 0`, which is 0
/// for a finite sum), whose scale is NaN as `clip_factor`'s is. None where the sum has several
/// parts (gradients on several devices besides a placement): its value needs the host then.
///
/// [`Optimizer::queue_apply`]: super::Optimizer::queue_apply
pub fn clip_ratio(sum: &QueuedSum, max_norm: f64) -> Result<Option<Tensor>> {
    let _ng = no_grad();
    match sum.parts() {
        [one] => {
            let ratio = one.sqrt()?.add_scalar(CLIP_EPS)?.rdiv_scalar(max_norm)?;
            Ok(Some(ratio.add(&one.mul_scalar(0.0)?)?))
        }
        _ => Ok(None),
    }
}

/// The ratio an update that skips exactly the non-finite steps on the device runs with
/// ([`Optimizer::apply_guarded_now`]): `clip_ratio(sum, m)` when clipping to `m`, else 1 (the
/// unclipped update, bit for bit), made NaN where the queued sum of squares `sum` or `loss`
/// (the step's loss, on the sum's placement) is not finite. None where its value needs the
/// host: a sum of several parts, or a loss elsewhere than the sum.
///
/// [`Optimizer::apply_guarded_now`]: super::Optimizer::apply_guarded_now
pub fn guard_ratio(
    sum: &QueuedSum,
    max_norm: Option<f64>,
    loss: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    let _ng = no_grad();
    let [one] = sum.parts() else {
        return Ok(None);
    };
    let ratio = match max_norm {
        Some(m) => match clip_ratio(sum, m)? {
            Some(r) => r,
            None => return Ok(None),
        },
        None => one.mul_scalar(0.0)?.add_scalar(1.0)?,
    };
    let Some(loss) = loss else {
        return Ok(Some(ratio));
    };
    let zero = loss.cast(DType::F64)?.sum_all()?.mul_scalar(0.0)?;
    let zero = match (zero.placement(), ratio.placement(), ratio.nd_sbp()) {
        (Some(p), Some(q), Some(nd)) if p == q => zero.to_global(q, nd.clone())?,
        (None, None, _) if zero.device() == ratio.device() => zero,
        _ => return Ok(None),
    };
    Ok(Some(ratio.add(&zero)?))
}

/// The value of a one-element tensor (every rank of its placement gets it).
fn scalar(t: &Tensor) -> Result<f64> {
    t.cast(DType::F64)?
        .to_vec::<f64>()?
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
