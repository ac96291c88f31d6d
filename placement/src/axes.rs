//! Named mesh axes: what an axis splits (`AxisRole`), the kinds of axis a job can have
//! (`AxisKind`: `pp`, `dp`, `ep`, `cp`, `tp`, in mesh order) and one axis of a layout
//! (`MeshAxis`: a kind and its size). Code finds an axis by its role, never by its number.

use std::fmt;

/// What a mesh axis splits. Each role is on at most one axis of a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AxisRole {
    /// Pipeline stages: each stage's placement is one slice along this axis.
    Stages,
    /// The batch (data parallelism): gradients are summed over the axis.
    Batch,
    /// Optimizer state, gradients and parameters sharded by ZeRO.
    Params,
    /// The sequence (context parallelism).
    Sequence,
    /// Attention heads and the MLP's hidden columns (tensor parallelism).
    Heads,
    /// The experts of a mixture of experts; how many tokens reach each expert is known only
    /// at run time (`oxiflow_sbp::RuntimeSplit` carries those sizes).
    Experts,
}

impl fmt::Display for AxisRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AxisRole::Stages => "pipeline stages",
            AxisRole::Batch => "batch",
            AxisRole::Params => "parameters (ZeRO)",
            AxisRole::Sequence => "sequence",
            AxisRole::Heads => "heads",
            AxisRole::Experts => "experts",
        })
    }
}

/// A kind of mesh axis: its name (also the name of its flag, `--<name>`), what it splits and
/// whether a stage's placement keeps it when its size is 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AxisKind {
    pub name: &'static str,
    pub roles: &'static [AxisRole],
    /// Kept in a stage's placement (and in messages) at size 1; others appear only above 1.
    pub kept_at_one: bool,
}

impl AxisKind {
    /// The kind named `name` (its flag `--<name>`) splitting `roles`, kept in a stage's
    /// placement at size 1 when `kept_at_one`.
    pub const fn new(
        name: &'static str,
        roles: &'static [AxisRole],
        kept_at_one: bool,
    ) -> AxisKind {
        AxisKind {
            name,
            roles,
            kept_at_one,
        }
    }

    /// Whether this kind of axis splits `role`.
    pub fn splits(&self, role: AxisRole) -> bool {
        self.roles.contains(&role)
    }
}

/// Pipeline stages.
pub const PP: AxisKind = AxisKind::new("pp", &[AxisRole::Stages], false);
/// Data parallelism: the batch, and what ZeRO shards.
pub const DP: AxisKind = AxisKind::new("dp", &[AxisRole::Batch, AxisRole::Params], true);
/// Expert parallelism: the experts of a mixture of experts.
pub const EP: AxisKind = AxisKind::new("ep", &[AxisRole::Experts], false);
/// Context parallelism: the sequence.
pub const CP: AxisKind = AxisKind::new("cp", &[AxisRole::Sequence], false);
/// Tensor parallelism: heads and MLP columns.
pub const TP: AxisKind = AxisKind::new("tp", &[AxisRole::Heads], true);

/// The kinds of axis a job's layout is made of, in mesh order (the first varies slowest over
/// the ranks: a stage's ranks are contiguous, a tensor-parallel group's neighbours).
pub const JOB_AXES: [AxisKind; 5] = [PP, DP, EP, CP, TP];

/// One axis of a layout: its kind and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshAxis {
    pub kind: AxisKind,
    pub size: usize,
}

impl MeshAxis {
    pub fn new(kind: AxisKind, size: usize) -> MeshAxis {
        MeshAxis { kind, size }
    }

    pub fn name(&self) -> &'static str {
        self.kind.name
    }

    /// Whether a stage's placement (and a message listing the layout) shows this axis.
    pub fn shown(&self) -> bool {
        self.kind.kept_at_one || self.size > 1
    }
}

impl fmt::Display for MeshAxis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "--{} {}", self.kind.name, self.size)
    }
}

/// `axes` as `--a 2 x --b 3`: the axes as their flags give them.
pub(crate) fn axes_text<'a>(axes: impl IntoIterator<Item = &'a MeshAxis>) -> String {
    axes.into_iter()
        .map(MeshAxis::to_string)
        .collect::<Vec<_>>()
        .join(" x ")
}
