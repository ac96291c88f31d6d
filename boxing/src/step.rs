//! One step of a boxing plan: what it does (a collective on one mesh axis, a local slice, a
//! point-to-point move of slice intersections with its transfers, a device copy), its groups,
//! layouts and bytes.

use oxiflow_placement::DeviceType;
use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceOp, Region, Sbp};
use rustc_hash::FxHashMap;

/// What one step does.
#[derive(Clone, Debug)]
pub enum StepKind {
    /// A change on a mesh axis of extent 1: the data is already right.
    Relabel,
    /// S(dim) -> B on a mesh axis: all-gather(-v).
    AllGather { dim: usize },
    /// P -> B: all-reduce.
    AllReduce { op: ReduceOp },
    /// P -> S(dim): reduce-scatter(-v).
    ReduceScatter { dim: usize, op: ReduceOp },
    /// S(from_dim) -> S(to_dim): all-to-all(-v).
    AllToAll { from_dim: usize, to_dim: usize },
    /// B -> S(dim): each rank keeps its slice.
    LocalSlice { dim: usize },
    /// B or S -> P(op): coordinate 0 (or the own slice) keeps the value, the rest the identity.
    PartialZero { op: ReduceOp },
    /// Move slice intersections between ranks (all-to-all-v on the union of both rank sets).
    P2p(Box<P2pPlan>),
    /// Copy each piece to another device type, rank by rank.
    DeviceCopy { from: DeviceType, to: DeviceType },
}

impl StepKind {
    pub fn name(&self) -> &'static str {
        match self {
            StepKind::Relabel => "relabel",
            StepKind::AllGather { .. } => "all-gather",
            StepKind::AllReduce { .. } => "all-reduce",
            StepKind::ReduceScatter { .. } => "reduce-scatter",
            StepKind::AllToAll { .. } => "all-to-all",
            StepKind::LocalSlice { .. } => "local-slice",
            StepKind::PartialZero { .. } => "partial-zero",
            StepKind::P2p(_) => "p2p-intersections",
            StepKind::DeviceCopy { .. } => "device-copy",
        }
    }
}

/// One step of a plan.
#[derive(Clone, Debug)]
pub struct Step {
    pub kind: StepKind,
    /// The mesh axis a per-axis step runs on.
    pub axis: Option<usize>,
    /// The rank groups (world ranks) that run the step, each group on its own.
    pub groups: Vec<Vec<usize>>,
    /// Layout before and after the step (`after.nd_sbp()` is the intermediate nd-SBP).
    pub before: GlobalLayout,
    pub after: GlobalLayout,
    /// Most bytes any rank receives in this step, and the sum over all ranks.
    pub bytes_max: u64,
    pub bytes_total: u64,
}

impl Step {
    /// SBP of the step's axis before and after (per-axis steps only).
    pub fn axis_sbps(&self) -> Option<(Sbp, Sbp)> {
        self.axis
            .map(|a| (self.before.nd_sbp()[a], self.after.nd_sbp()[a]))
    }
    /// A one-line description (used in errors and `explain`).
    pub fn describe(&self) -> String {
        match (&self.kind, self.axis_sbps()) {
            (StepKind::P2p(_), _) => {
                format!("{} {} -> {}", self.kind.name(), self.before, self.after)
            }
            (StepKind::DeviceCopy { from, to }, _) => format!("device-copy {from} -> {to}"),
            (k, Some((a, b))) => format!(
                "{} {a} -> {b} on mesh axis {}",
                k.name(),
                self.axis.unwrap_or(0)
            ),
            (k, None) => k.name().to_string(),
        }
    }
}

/// One piece of data moving from `src` to `dst` (world ranks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub src: usize,
    pub dst: usize,
    /// Global index ranges moved.
    pub region: Region,
    /// Reduce into the destination (a later P component) rather than write.
    pub accumulate: bool,
}

/// The data movement of a point-to-point step.
#[derive(Clone, Debug)]
pub struct P2pPlan {
    /// World ranks of both placements, ascending: the communicator's member order.
    pub union: Vec<usize>,
    /// Ordered by destination (target mesh order), then P component, then source tile.
    pub transfers: Vec<Transfer>,
    /// The source's partial reduction, if any.
    pub reduce: Option<ReduceOp>,
    /// Whether any transfer crosses ranks (else no communication at all).
    pub needs_comm: bool,
    /// Per world rank: indices into `transfers` it sends to other ranks, ordered by the
    /// destination's member index (then plan order), and those it receives from other ranks,
    /// ordered by the source's member index. Precomputed so execution is linear in its own data.
    pub io: FxHashMap<usize, RankIo>,
}

/// The remote transfers of one rank, in the order the all-to-all-v lays them out.
#[derive(Clone, Debug, Default)]
pub struct RankIo {
    pub sends: Vec<usize>,
    pub recvs: Vec<usize>,
}

/// The single reduce op of an nd-SBP's partial axes (None if it has none); Err when mixed.
pub(crate) fn partial_op(nd: &NdSbp) -> Result<Option<ReduceOp>, ()> {
    let mut op = None;
    for s in nd.iter() {
        if let Sbp::Partial(o) = s {
            match op {
                None => op = Some(o),
                Some(p) if p != o => return Err(()),
                _ => {}
            }
        }
    }
    Ok(op)
}
