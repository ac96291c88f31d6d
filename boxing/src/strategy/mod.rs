//! Transfer strategies, one file each; this module holds what the per-axis ones share: the
//! group tensor of a mesh-axis group and the context a per-axis step runs in.

pub(crate) mod all_gather;
pub(crate) mod all_reduce;
pub(crate) mod all_to_all;
pub(crate) mod device_copy;
pub(crate) mod local_slice;
pub(crate) mod p2p_intersections;
pub(crate) mod partial_zero;
pub(crate) mod reduce_scatter;

use oxiflow_collectives::SharedComm;
use oxiflow_sbp::{BalancedSplitter, GlobalLayout, Region, Sbp, Shape};

use crate::region::shape_of;

/// Global index ranges of the "group tensor" that the mesh-axis group of the rank at `coord`
/// jointly holds: the region the layout gives with `axis` treated as B. A single-axis step is
/// a 1-d transition of this tensor over the group.
pub(crate) fn group_region(layout: &GlobalLayout, axis: usize, coord: &[usize]) -> Region {
    let mut region: Region = layout.shape().dims().iter().map(|&n| 0..n).collect();
    let mesh = layout.placement().shape();
    for (a, sbp) in layout.nd_sbp().iter().enumerate() {
        if a == axis {
            continue;
        }
        if let Sbp::Split(d) = sbp {
            let r = &region[d];
            let part = BalancedSplitter::new(r.len(), mesh[a]).range(coord[a]);
            region[d] = r.start + part.start..r.start + part.end;
        }
    }
    region
}

/// What a per-axis step needs on one rank: the axis group's communicator, this rank's index in
/// it, and the group tensor's shape.
pub(crate) struct AxisCtx {
    /// The axis group's communicator; None for steps that do not communicate.
    pub comm: Option<SharedComm>,
    pub me: usize,
    pub p: usize,
    pub group_shape: Shape,
}

impl AxisCtx {
    pub fn new(comm: Option<SharedComm>, me: usize, p: usize, group: &Region) -> AxisCtx {
        AxisCtx {
            comm,
            me,
            p,
            group_shape: shape_of(group),
        }
    }
    pub fn comm(&self) -> Result<&SharedComm, crate::BoxingError> {
        self.comm.as_ref().ok_or_else(|| crate::BoxingError::Local {
            op: "per-axis step".into(),
            detail: "communicating step run without its group communicator".into(),
        })
    }
    /// The balanced parts of group-tensor dim `dim` over the group.
    pub fn split(&self, dim: usize) -> BalancedSplitter {
        BalancedSplitter::new(self.group_shape.dim(dim), self.p)
    }
    /// Elements of each member's part of the group tensor split on `dim`, in member order.
    pub fn counts(&self, dim: usize) -> Vec<usize> {
        let sp = self.split(dim);
        let other = self.group_shape.numel() / self.group_shape.dim(dim).max(1);
        (0..self.p).map(|i| sp.size(i) * other).collect()
    }
    /// The box of the group tensor (local coordinates) with `dim` restricted to member `i`'s
    /// part.
    pub fn part_box(&self, shape: &Shape, dim: usize, i: usize) -> Region {
        let mut r: Region = shape.dims().iter().map(|&n| 0..n).collect();
        r[dim] = self.split(dim).range(i);
        r
    }
}
