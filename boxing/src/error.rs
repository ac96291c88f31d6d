//! `BoxingError`: the one error type of planning and executing boxing.
//!
//! Every dtype OxiFlow has (f32, f64, i64) reduces with sum, max and min, so a partial SBP is
//! never refused for its dtype. What is refused: layouts that do not fit the shape, placements
//! naming ranks outside the communicator, source and target of different global shapes, an
//! nd-SBP mixing partial reductions (e.g. `(P(sum), P(max))`, whose value is ambiguous), and a
//! local piece whose dtype, shape or device does not match the plan.

use oxiflow_collectives::CommError;
use oxiflow_dtype::DType;
use oxiflow_placement::PlacementError;
use oxiflow_sbp::SbpError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum BoxingError {
    /// The nd-SBP does not fit the shape or placement (wrong length, split dim out of range).
    #[error("boxing: invalid layout: {0}")]
    Layout(#[from] SbpError),
    #[error("boxing: {0}")]
    Placement(#[from] PlacementError),
    #[error("boxing {from} -> {to}: global shapes differ ({from_shape} vs {to_shape})")]
    ShapeMismatch {
        from: String,
        to: String,
        from_shape: String,
        to_shape: String,
    },
    #[error(
        "boxing {layout}: nd-SBP {nd_sbp} mixes partial reductions; use one reduce op per tensor"
    )]
    MixedPartial { layout: String, nd_sbp: String },
    #[error("boxing {from} -> {to}: placement {placement} names world rank {rank}, which is not a member of the communicator (world ranks {world:?})")]
    RankOutsideWorld {
        from: String,
        to: String,
        placement: String,
        rank: usize,
        world: Vec<usize>,
    },
    #[error("boxing {from} -> {to}: rank {rank}: local piece has shape {got}, the layout gives it {expected}")]
    LocalShape {
        from: String,
        to: String,
        rank: usize,
        expected: String,
        got: String,
    },
    #[error("boxing {from} -> {to}: rank {rank}: local piece has dtype {got}, the plan is for {expected}")]
    DTypeMismatch {
        from: String,
        to: String,
        rank: usize,
        expected: DType,
        got: DType,
    },
    #[error("boxing {from} -> {to}: rank {rank}: {detail}")]
    Piece {
        from: String,
        to: String,
        rank: usize,
        detail: String,
    },
    #[error("boxing: {op}: {detail}")]
    Local { op: String, detail: String },
    #[error("boxing: device {device} is not supported by this piece type ({op})")]
    UnsupportedDevice { op: String, device: String },
    #[error("boxing step `{step}`: {source}")]
    Comm {
        step: String,
        #[source]
        source: CommError,
    },
}
