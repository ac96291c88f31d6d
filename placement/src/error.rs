//! Typed errors for building, parsing and querying placements.

use thiserror::Error;

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
}
