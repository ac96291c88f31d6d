//! Placements: a device type and an n-d mesh of distinct ranks that holds a global tensor.
//!
//! `Placement` owns all mesh index math (rank <-> coordinate, per-axis groups, sub-meshes);
//! `DeviceType` is the closed set of devices a placement can name.

mod device;
mod error;
mod mesh;
mod parse;

pub use device::DeviceType;
pub use error::PlacementError;
pub use mesh::Placement;
pub use parse::MAX_NESTING;
