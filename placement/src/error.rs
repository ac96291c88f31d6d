//! Typed errors for building, parsing and querying placements.

use thiserror::Error;

use crate::axes::{axes_text, MeshAxis};

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlacementError {
    #[error("unknown device type {0:?} (expected \"cpu\" or \"cuda\")")]
    UnknownDevice(String),
    #[error("placement has an empty mesh (shape {shape:?})")]
    EmptyMesh { shape: Vec<usize> },
    #[error("placement mesh shape {shape:?} holds {expected} ranks but {got} ranks were given: {ranks:?}")]
    ShapeMismatch {
        shape: Vec<usize>,
        expected: usize,
        got: usize,
        ranks: Vec<usize>,
    },
    #[error("placement mesh shape {shape:?} holds more ranks than fit in usize")]
    MeshTooLarge { shape: Vec<usize> },
    #[error("placement text nests lists deeper than {limit} levels at byte {pos}")]
    TooDeep { limit: usize, pos: usize },
    #[error("placement names rank {rank} more than once: {ranks:?}")]
    DuplicateRank { rank: usize, ranks: Vec<usize> },
    #[error("placement {placement} names rank {rank}, outside the world of {world_size} ranks")]
    RankOutsideWorld {
        placement: String,
        rank: usize,
        world_size: usize,
    },
    #[error("ragged nested rank list in {text:?}: {detail}")]
    Ragged { text: String, detail: String },
    #[error("cannot parse placement {text:?} at byte {pos}: {detail}")]
    Parse {
        text: String,
        pos: usize,
        detail: String,
    },
    #[error("mesh axis {axis} out of range for placement {placement} with {ndim} axes")]
    AxisOutOfRange {
        axis: usize,
        ndim: usize,
        placement: String,
    },
    #[error("mesh coordinate {coord:?} out of range for mesh shape {shape:?}")]
    CoordOutOfRange {
        coord: Vec<usize>,
        shape: Vec<usize>,
    },
    #[error("mesh axis --{name} has size 0 (at least 1)")]
    EmptyAxis { name: String },
    #[error("mesh axis {name} appears twice in {axes}")]
    DuplicateAxis { name: String, axes: String },
    #[error("mesh axes {first} and {second} both split the {role}: a role is on one axis")]
    RoleTwice {
        role: String,
        first: String,
        second: String,
    },
    #[error("the pipeline axis {name} must be the first mesh axis of {axes}")]
    StagesNotFirst { name: String, axes: String },
    #[error("mesh axes {first} and {second} both left to infer from the world size: give one")]
    InferTwice { first: String, second: String },
    #[error("{} does not divide the world size {world}", axes_text(.axes))]
    AxesDoNotDivide { axes: Vec<MeshAxis>, world: usize },
    #[error("{} must equal the world size {world}", axes_text(.axes))]
    AxesNotWorld { axes: Vec<MeshAxis>, world: usize },
    #[error("mesh axes {axes} do not match the shape of placement {placement}")]
    AxesNotMesh { axes: String, placement: String },
}
