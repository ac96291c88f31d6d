//! The byte cost model shared by signature inference and boxing: what one 1-d transition on a
//! mesh axis costs (bytes received per rank, docs/design.md's boxing table), and an n-d estimate as
//! a sum of per-axis steps.

use smallvec::SmallVec;

use crate::{BalancedSplitter, GlobalLayout, NdSbp, Sbp, Shape};

/// Bytes each rank receives to turn a tensor of `tensor_bytes` logical bytes (the piece the
/// axis group holds together) from `from` to `to` on one mesh axis of `p` ranks:
///
/// | from -> to | how | bytes |
/// |---|---|---|
/// | equal, or p = 1 | nothing | 0 |
/// | S(i) -> B | all-gather | (p-1)/p T |
/// | P(op) -> B | all-reduce (ring) | 2(p-1)/p T |
/// | P(op) -> S(i) | reduce-scatter | (p-1)/p T |
/// | S(i) -> S(j) | all-to-all | (p-1)/p^2 T |
/// | B -> S(i), B -> P(op), S(i) -> P(op) | local slice / keep one copy / pad with the identity | 0 |
/// | P(op) -> P(other) | via B: all-reduce, then keep one copy | 2(p-1)/p T |
///
/// Integer division rounds down; the result saturates at `u64::MAX`.
pub fn transition_cost_1d(from: Sbp, to: Sbp, tensor_bytes: u64, p: usize) -> u64 {
    if from == to || p <= 1 {
        return 0;
    }
    let t = u128::from(tensor_bytes);
    let p = p as u128;
    let bytes = match (from, to) {
        (Sbp::Split(_), Sbp::Broadcast) => t * (p - 1) / p,
        (Sbp::Partial(_), Sbp::Broadcast) => 2 * t * (p - 1) / p,
        (Sbp::Partial(_), Sbp::Split(_)) => t * (p - 1) / p,
        (Sbp::Split(_), Sbp::Split(_)) => t * (p - 1) / (p * p),
        (Sbp::Broadcast, _) | (Sbp::Split(_), Sbp::Partial(_)) => 0,
        (Sbp::Partial(_), Sbp::Partial(_)) => 2 * t * (p - 1) / p,
    };
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

/// Bytes of the piece that one group of ranks along mesh `axis` holds together under `nd`:
/// the region of mesh coordinate 0 (the largest under balanced splits) with `axis` itself
/// taken as B.
pub fn axis_group_bytes(
    shape: &Shape,
    mesh: &[usize],
    nd: &NdSbp,
    axis: usize,
    elem_size: usize,
) -> u64 {
    let mut dims: SmallVec<[usize; 6]> = shape.dims().iter().copied().collect();
    for (a, s) in nd.iter().enumerate() {
        if a == axis {
            continue;
        }
        if let (Sbp::Split(d), Some(&p)) = (s, mesh.get(a)) {
            if let Some(n) = dims.get_mut(d) {
                *n = BalancedSplitter::new(*n, p.max(1)).size(0);
            }
        }
    }
    let numel = dims
        .iter()
        .fold(1u64, |acc, &n| acc.saturating_mul(n as u64));
    numel.saturating_mul(elem_size as u64)
}

/// Estimated bytes received per rank to turn `layout_from` into nd-SBP `to` on the same
/// placement: per-axis 1-d steps (`transition_cost_1d`), each on the piece its axis group holds
/// at that point (`axis_group_bytes` of the partly converted nd-SBP), axes taken in order
/// 0..n or n..0, whichever is cheaper. `u64::MAX` when `to` has the wrong length. The boxing
/// planner computes exact plans, but prices each of its steps with `transition_cost_1d`.
pub fn transition_cost(layout_from: &GlobalLayout, to: &NdSbp, elem_size: usize) -> u64 {
    transition_cost_parts(
        layout_from.shape(),
        layout_from.placement().shape(),
        layout_from.nd_sbp(),
        to,
        elem_size,
    )
}

/// The cost signature inference ranks candidates by: `transition_cost` plus, for every mesh axis
/// where an input goes from S to P, the reduce-scatter that later turns the partial back into a
/// split ((p-1)/p of the axis group's bytes). S -> P itself moves no bytes, but it defers a
/// reduction of the full tensor; without this term an uneven reshape of an S input would pick a
/// zero-padded P instead of boxing to B.
pub fn inference_cost(layout_from: &GlobalLayout, to: &NdSbp, elem_size: usize) -> u64 {
    inference_cost_parts(
        layout_from.shape(),
        layout_from.placement().shape(),
        layout_from.nd_sbp(),
        to,
        elem_size,
    )
}

/// `inference_cost` on the parts of a layout.
pub(crate) fn inference_cost_parts(
    shape: &Shape,
    mesh: &[usize],
    from: &NdSbp,
    to: &NdSbp,
    elem_size: usize,
) -> u64 {
    let base = transition_cost_parts(shape, mesh, from, to, elem_size);
    if base == u64::MAX {
        return base;
    }
    from.iter()
        .zip(to.iter())
        .enumerate()
        .filter(|(_, (f, t))| f.is_split() && t.is_partial())
        .fold(base, |acc, (a, (f, _))| {
            let bytes = axis_group_bytes(shape, mesh, from, a, elem_size);
            acc.saturating_add(transition_cost_1d(Sbp::P, f, bytes, mesh[a]))
        })
}

/// `transition_cost` on the parts of a layout (no layout needs to be built).
pub(crate) fn transition_cost_parts(
    shape: &Shape,
    mesh: &[usize],
    from: &NdSbp,
    to: &NdSbp,
    elem_size: usize,
) -> u64 {
    if from.len() != mesh.len() || to.len() != mesh.len() {
        return u64::MAX;
    }
    if from == to {
        return 0;
    }
    let forward = ordered_cost(shape, mesh, from, to, elem_size, (0..mesh.len()).collect());
    if mesh.len() == 1 {
        return forward;
    }
    let backward = ordered_cost(
        shape,
        mesh,
        from,
        to,
        elem_size,
        (0..mesh.len()).rev().collect(),
    );
    forward.min(backward)
}

fn ordered_cost(
    shape: &Shape,
    mesh: &[usize],
    from: &NdSbp,
    to: &NdSbp,
    elem_size: usize,
    order: SmallVec<[usize; 4]>,
) -> u64 {
    let mut cur = from.clone();
    let mut total = 0u64;
    for a in order {
        if cur[a] == to[a] {
            continue;
        }
        let bytes = axis_group_bytes(shape, mesh, &cur, a, elem_size);
        total = total.saturating_add(transition_cost_1d(cur[a], to[a], bytes, mesh[a]));
        cur.set(a, to[a]);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReduceOp;
    use oxiflow_placement::{DeviceType, Placement};

    #[test]
    fn table_1d() {
        let t = 1200;
        assert_eq!(transition_cost_1d(Sbp::S(0), Sbp::B, t, 4), 900);
        assert_eq!(transition_cost_1d(Sbp::P, Sbp::B, t, 4), 1800);
        assert_eq!(transition_cost_1d(Sbp::P, Sbp::S(1), t, 4), 900);
        assert_eq!(transition_cost_1d(Sbp::S(0), Sbp::S(1), t, 4), 225);
        assert_eq!(transition_cost_1d(Sbp::B, Sbp::S(1), t, 4), 0);
        assert_eq!(transition_cost_1d(Sbp::B, Sbp::P, t, 4), 0);
        assert_eq!(transition_cost_1d(Sbp::S(0), Sbp::P, t, 4), 0);
        assert_eq!(
            transition_cost_1d(Sbp::B, Sbp::Partial(ReduceOp::Max), t, 4),
            0
        );
        assert_eq!(
            transition_cost_1d(Sbp::P, Sbp::Partial(ReduceOp::Max), t, 4),
            1800
        );
        assert_eq!(transition_cost_1d(Sbp::S(0), Sbp::B, t, 1), 0);
        assert_eq!(
            transition_cost_1d(Sbp::S(0), Sbp::B, u64::MAX, 4),
            u64::MAX / 4 * 3 + 2
        );
    }

    #[test]
    fn nd_sums_axis_steps() {
        let p = Placement::new(DeviceType::Cpu, [2, 4], (0..8).collect::<Vec<_>>()).unwrap();
        let l = GlobalLayout::new([8, 8], &p, [Sbp::S(0), Sbp::S(1)]).unwrap();
        // Axis 1 first (S(1) -> B) on the half that axis 0 leaves: 128 B * 3/4 = 96; then
        // axis 0 (S(0) -> B) on the whole 256 B: 128. Axis 0 first: 64 * 1/2 + 256 * 3/4.
        assert_eq!(transition_cost(&l, &NdSbp::broadcast(2), 4), 96 + 128);
        let l = GlobalLayout::new([8, 8], &p, [Sbp::P, Sbp::S(1)]).unwrap();
        // Axis 0 first: P -> B on 64 B (2 * 1/2 * 64 = 64), then S(1) -> B on 256 B (192).
        // Axis 1 first: S(1) -> B on 256 B (192), then P -> B on 256 B (256).
        assert_eq!(transition_cost(&l, &NdSbp::broadcast(2), 4), 64 + 192);
        assert_eq!(transition_cost(&l, l.nd_sbp(), 4), 0);
        assert_eq!(transition_cost(&l, &NdSbp::from(Sbp::B), 4), u64::MAX);
    }
}
