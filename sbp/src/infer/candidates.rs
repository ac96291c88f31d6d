//! The n-d candidates of a rule table: the per-axis candidates combined over the mesh axes,
//! and the checks an n-d candidate needs beyond them.

use oxiflow_placement::Placement;
use smallvec::SmallVec;

use super::{reshape, Rules};
use crate::{NdSbp, Sbp};

/// Whether an n-d candidate (one per-axis candidate index per mesh axis) is valid beyond what
/// the per-axis tables say: no tensor mixes partial reductions over its mesh axes (boxing runs
/// one reduce op per tensor), a reshape's nested splits line up, and an even split asked for
/// ([`Rules::with_even_split`]) is even.
pub(crate) fn nd_ok(rules: &Rules, placement: &Placement, ins: &[NdSbp], outs: &[NdSbp]) -> bool {
    if ins.iter().chain(outs).any(NdSbp::mixes_partials) {
        return false;
    }
    if let Some((input, dim, groups)) = rules.even_split {
        let ways: usize = ins.get(input).map_or(1, |nd| {
            nd.iter()
                .zip(placement.shape())
                .filter(|(s, _)| *s == Sbp::S(dim))
                .map(|(_, &n)| n)
                .product()
        });
        if groups % ways.max(1) != 0 {
            return false;
        }
    }
    match &rules.reshape_from {
        Some(x) => reshape::nd_ok(x, &rules.out_shapes[0], placement, &ins[0], &outs[0]),
        None => true,
    }
}

/// Visits all n-d candidates in order: the product of the per-axis candidates over the mesh
/// axes, axis 0 outermost (the last axis varies fastest), filtered by `nd_ok`. `visit` gets the
/// input and output nd-SBPs of each, in buffers reused between calls (no allocation per
/// candidate).
pub(crate) fn for_each_nd(
    rules: &Rules,
    placement: &Placement,
    mut visit: impl FnMut(&[NdSbp], &[NdSbp]),
) {
    let axes = placement.ndim();
    let k = rules.axis.len();
    if k == 0 {
        return;
    }
    let first = &rules.axis[0];
    let mut ins: SmallVec<[NdSbp; 3]> =
        first.ins.iter().map(|&s| NdSbp::uniform(s, axes)).collect();
    let mut outs: SmallVec<[NdSbp; 3]> = first
        .outs
        .iter()
        .map(|&s| NdSbp::uniform(s, axes))
        .collect();
    let mut idx: SmallVec<[usize; 4]> = SmallVec::from_elem(0, axes);
    loop {
        if nd_ok(rules, placement, &ins, &outs) {
            visit(&ins, &outs);
        }
        // Next index, last axis fastest; refresh the axes that changed.
        let mut a = axes;
        loop {
            if a == 0 {
                return;
            }
            a -= 1;
            idx[a] = (idx[a] + 1) % k;
            let c = &rules.axis[idx[a]];
            for (nd, &s) in ins.iter_mut().zip(&c.ins) {
                nd.set(a, s);
            }
            for (nd, &s) in outs.iter_mut().zip(&c.outs) {
                nd.set(a, s);
            }
            if idx[a] != 0 {
                break;
            }
        }
    }
}
