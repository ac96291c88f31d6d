//! Typed errors of the SBP algebra and signature inference.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SbpError {
    #[error(
        "nd-SBP {nd_sbp} has {got} entries but placement {placement} has {expected} mesh axes"
    )]
    NdLengthMismatch {
        nd_sbp: String,
        placement: String,
        expected: usize,
        got: usize,
    },
    #[error(
        "{sbp} in nd-SBP {nd_sbp} splits dim {dim}, out of range for shape {shape} ({ndim} dims)"
    )]
    SplitDimOutOfRange {
        sbp: String,
        nd_sbp: String,
        dim: usize,
        ndim: usize,
        shape: String,
    },
    #[error("cannot parse SBP {text:?}: {detail}")]
    Parse { text: String, detail: String },
    #[error("{op}: {detail}")]
    Infer { op: String, detail: String },
    /// An op's attributes or input shapes are inconsistent (signature inference).
    #[error("{op}: {detail}; inputs {shapes} with nd-SBPs {sbps} on {placement}")]
    Op {
        op: String,
        detail: String,
        shapes: String,
        sbps: String,
        placement: String,
    },
    /// One input of an op has an nd-SBP that does not fit its shape or the placement.
    #[error("{op}: input {index}: {source}")]
    Input {
        op: String,
        index: usize,
        source: Box<SbpError>,
    },
    /// A split with run-time sizes that does not fit its layout.
    #[error("run-time split on mesh axis {axis} of {layout}: {detail}")]
    RuntimeSplit {
        layout: String,
        axis: usize,
        detail: String,
    },
    #[error(transparent)]
    Placement(#[from] oxiflow_placement::PlacementError),
}
