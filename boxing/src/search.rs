//! The n-d search: cheapest sequence of valid single-axis steps (Dijkstra over nd-SBP states,
//! cost = bytes received per rank, deterministic tie-breaks) on one placement.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use oxiflow_dtype::DType;
use oxiflow_sbp::{GlobalLayout, NdSbp, Sbp};
use rustc_hash::FxHashMap;

use crate::region::numel;
use crate::step::{partial_op, Step, StepKind};
use crate::strategy::group_region;
use crate::BoxingError;
use oxiflow_sbp::transition_cost_1d;

/// The kind of a single-axis step from `a` to `b` on an axis of extent `p`; None when there is
/// no direct step (a change of partial reduction goes through B).
fn axis_kind(a: Sbp, b: Sbp, p: usize) -> Option<StepKind> {
    if a == b {
        return None;
    }
    if p == 1 {
        return Some(StepKind::Relabel);
    }
    Some(match (a, b) {
        (Sbp::Split(d), Sbp::Broadcast) => StepKind::AllGather { dim: d },
        (Sbp::Partial(op), Sbp::Broadcast) => StepKind::AllReduce { op },
        (Sbp::Partial(op), Sbp::Split(d)) => StepKind::ReduceScatter { dim: d, op },
        (Sbp::Split(f), Sbp::Split(t)) => StepKind::AllToAll {
            from_dim: f,
            to_dim: t,
        },
        (Sbp::Broadcast, Sbp::Split(d)) => StepKind::LocalSlice { dim: d },
        (Sbp::Broadcast | Sbp::Split(_), Sbp::Partial(op)) => StepKind::PartialZero { op },
        (Sbp::Partial(_), Sbp::Partial(_)) | (Sbp::Broadcast, Sbp::Broadcast) => return None,
    })
}

/// Whether changing `axis` of `state` to `to` is a valid single-axis step: no later axis splits
/// the dim the axis splits before or after (else nested balanced ranges do not line up).
fn valid(state: &NdSbp, axis: usize, to: Sbp) -> bool {
    let dims = [state[axis].split_dim(), to.split_dim()];
    state.as_slice()[axis + 1..]
        .iter()
        .all(|s| s.split_dim().is_none() || !dims.contains(&s.split_dim()))
}

/// Builds the single-axis step `axis: before[axis] -> to` with its groups and bytes.
pub(crate) fn axis_step(
    before: &GlobalLayout,
    axis: usize,
    to: Sbp,
    dtype: DType,
) -> Result<Option<Step>, BoxingError> {
    let from = before.nd_sbp()[axis];
    let placement = before.placement();
    let p = placement.shape()[axis];
    let Some(kind) = axis_kind(from, to, p) else {
        return Ok(None);
    };
    let after = before.with_nd_sbp(before.nd_sbp().with_axis(axis, to))?;
    let groups = placement.axis_groups(axis)?;
    let (mut bytes_max, mut bytes_total) = (0u64, 0u64);
    for g in &groups {
        let coord = placement.coord_of(g[0]).unwrap_or_default();
        let bytes = (numel(&group_region(before, axis, &coord)) * dtype.size()) as u64;
        let c = transition_cost_1d(from, to, bytes, p);
        bytes_max = bytes_max.max(c);
        bytes_total += c * p as u64;
    }
    Ok(Some(Step {
        kind,
        axis: Some(axis),
        groups,
        before: before.clone(),
        after,
        bytes_max,
        bytes_total,
    }))
}

/// The cheapest per-axis plan from `from` to nd-SBP `target` on `from`'s placement.
pub(crate) fn axis_plan(
    from: &GlobalLayout,
    target: &NdSbp,
    dtype: DType,
) -> Result<Vec<Step>, BoxingError> {
    let ndim = from.shape().ndim();
    let m = from.placement().ndim();
    // Candidate SBPs for an axis: every split, B, and the target's own SBP on that axis.
    let mut base: Vec<Sbp> = (0..ndim).map(Sbp::Split).collect();
    base.push(Sbp::Broadcast);

    let start = from.nd_sbp().clone();
    let mut dist: FxHashMap<NdSbp, (u64, usize)> = FxHashMap::default();
    let mut prev: FxHashMap<NdSbp, (NdSbp, Step)> = FxHashMap::default();
    let mut layouts: FxHashMap<NdSbp, GlobalLayout> = FxHashMap::default();
    let mut heap = BinaryHeap::new();
    dist.insert(start.clone(), (0, 0));
    layouts.insert(start.clone(), from.clone());
    heap.push(Reverse((0u64, 0usize, start.clone())));
    let mut reached = false;
    while let Some(Reverse((cost, nsteps, state))) = heap.pop() {
        if state == *target {
            reached = true;
            break;
        }
        if dist.get(&state).is_some_and(|&d| d < (cost, nsteps)) {
            continue;
        }
        let Some(layout) = layouts.get(&state).cloned() else {
            continue;
        };
        for axis in 0..m {
            let mut cands = base.clone();
            if target[axis].is_partial() {
                cands.push(target[axis]);
            }
            for &x in &cands {
                if x == state[axis] || !valid(&state, axis, x) {
                    continue;
                }
                let next = state.with_axis(axis, x);
                if partial_op(&next).is_err() {
                    continue;
                }
                let Some(step) = axis_step(&layout, axis, x, dtype)? else {
                    continue;
                };
                let nc = (cost + step.bytes_max, nsteps + 1);
                if dist.get(&next).is_none_or(|&d| nc < d) {
                    dist.insert(next.clone(), nc);
                    layouts.insert(next.clone(), step.after.clone());
                    prev.insert(next.clone(), (state.clone(), step));
                    heap.push(Reverse((nc.0, nc.1, next)));
                }
            }
        }
    }
    if !reached {
        // Unreachable by construction (every state reaches all-B and all-B reaches any state);
        // reported rather than assumed.
        return Err(BoxingError::Local {
            op: "boxing search".into(),
            detail: format!("no per-axis path from {} to {target}", from),
        });
    }
    let mut steps = Vec::new();
    let mut cur = target.clone();
    while cur != start {
        let Some((p, step)) = prev.remove(&cur) else {
            break;
        };
        steps.push(step);
        cur = p;
    }
    steps.reverse();
    Ok(steps)
}
