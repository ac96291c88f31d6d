//! Candidate table of reshape: a split survives when it lands on the leading dim of a merged or
//! split dim group and every rank's piece stays one contiguous run of that group.

use oxiflow_placement::Placement;
use smallvec::SmallVec;

use super::{RuleMode, Rules, PARTIALS};
use crate::{BalancedSplitter, NdSbp, Sbp, Shape};

/// A dim pair that may carry a split through a reshape: input dim `a` and output dim `b` lead
/// the same group; `inner_a` / `inner_b` are the products of the group's dims after them.
#[derive(Clone, Copy, Debug)]
struct Pair {
    a: usize,
    b: usize,
    inner_a: usize,
    inner_b: usize,
}

/// Groups x and y into runs of dims with equal products (row-major reshape keeps each run
/// contiguous) and returns, per group, its leading non-1 dims on both sides. Empty tensors
/// keep no splits.
fn pairs(x: &Shape, y: &Shape) -> SmallVec<[Pair; 6]> {
    let mut out = SmallVec::new();
    if x.numel() == 0 {
        return out;
    }
    let (n, m) = (x.ndim(), y.ndim());
    let (mut i, mut j) = (0, 0);
    while i < n && j < m {
        let (i0, j0) = (i, j);
        let (mut pa, mut pb) = (x.dim(i), y.dim(j));
        i += 1;
        j += 1;
        while pa != pb {
            if pa < pb && i < n {
                pa *= x.dim(i);
                i += 1;
            } else if pb < pa && j < m {
                pb *= y.dim(j);
                j += 1;
            } else {
                return out;
            }
        }
        let lead_a = (i0..i).find(|&d| x.dim(d) > 1);
        let lead_b = (j0..j).find(|&d| y.dim(d) > 1);
        if let (Some(a), Some(b)) = (lead_a, lead_b) {
            out.push(Pair {
                a,
                b,
                inner_a: x.dims()[a + 1..i].iter().product(),
                inner_b: y.dims()[b + 1..j].iter().product(),
            });
        }
    }
    out
}

/// S(a) -> S(b) for the leading dims of each group; B->B; any P->P.
pub fn reshape(x: &Shape, shape: &Shape, mode: RuleMode) -> Result<Rules, String> {
    if x.numel() != shape.numel() {
        return Err(format!(
            "cannot reshape {x} ({} elements) to {shape} ({} elements)",
            x.numel(),
            shape.numel()
        ));
    }
    let mut r = Rules::new(mode, [shape.clone()]);
    r.reshape_from = Some(x.clone());
    for p in pairs(x, shape) {
        r.push(&[Sbp::S(p.a)], &[Sbp::S(p.b)]);
    }
    r.push(&[Sbp::Broadcast], &[Sbp::Broadcast]);
    for m in PARTIALS {
        r.push(&[m], &[m]);
    }
    Ok(r)
}

/// The range of dim `dim` (of size `size`) that the rank at mesh position `idx` holds.
fn nested_range(
    size: usize,
    mesh: &[usize],
    nd: &NdSbp,
    dim: usize,
    mut idx: usize,
) -> (usize, usize) {
    // Row-major coordinate, computed from the last axis.
    let mut coord: SmallVec<[usize; 4]> = SmallVec::from_elem(0, mesh.len());
    for a in (0..mesh.len()).rev() {
        coord[a] = idx % mesh[a];
        idx /= mesh[a];
    }
    let (mut start, mut end) = (0, size);
    for (a, s) in nd.iter().enumerate() {
        if s == Sbp::Split(dim) {
            let part = BalancedSplitter::new(end - start, mesh[a]).range(coord[a]);
            (start, end) = (start + part.start, start + part.end);
        }
    }
    (start, end)
}

/// Whether every rank's input piece, reshaped locally, is exactly its output piece: for each
/// split group, the nested split ranges of the input dim and of the output dim cover the same
/// run of the group on every rank.
pub(super) fn nd_ok(
    x: &Shape,
    y: &Shape,
    placement: &Placement,
    input: &NdSbp,
    output: &NdSbp,
) -> bool {
    let mesh = placement.shape();
    pairs(x, y).iter().all(|p| {
        if !input.splits_dim(p.a) {
            return true;
        }
        (0..placement.num_ranks()).all(|idx| {
            let (sa, ea) = nested_range(x.dim(p.a), mesh, input, p.a, idx);
            let (sb, eb) = nested_range(y.dim(p.b), mesh, output, p.b, idx);
            sa * p.inner_a == sb * p.inner_b && ea * p.inner_a == eb * p.inner_b
        })
    })
}
