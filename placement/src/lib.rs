//! Placements: a device type and an n-d mesh of distinct ranks that holds a global tensor.
//!
//! `Placement` owns all mesh index math (rank <-> coordinate, per-axis groups, sub-meshes);
//! `DeviceType` is the closed set of devices a placement can name. `MeshLayout` is a job's
//! ordered list of named axes (`pp`, `dp`, `ep`, `cp`, `tp`) with their roles and sizes; each
//! pipeline stage's placement is a `NamedMesh`, whose axes are found by role.

mod axes;
mod device;
mod error;
mod layout;
mod mesh;
mod parse;

pub use axes::{AxisKind, AxisRole, MeshAxis, CP, DP, EP, JOB_AXES, PP, TP};
pub use device::DeviceType;
pub use error::PlacementError;
pub use layout::{MeshLayout, NamedMesh};
pub use mesh::Placement;
pub use parse::MAX_NESTING;
