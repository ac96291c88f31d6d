//! `TensorError`: the one error enum of the tensor crate; messages name op, shapes, SBPs and placements.

use thiserror::Error;

/// Every failure of tensor creation, dispatch, boxing and kernels.
///
/// Metadata errors (`Shape`, `DType`, `Placement`, `Sbp`, `Mixed`, `Device`) are raised before
/// any communication, from metadata every rank shares, so every rank raises the same error.
#[derive(Debug, Error)]
pub enum TensorError {
    /// Shapes of the operands do not fit the op (or an attribute is out of range).
    #[error("{op}: shape error: {detail} (input shapes {shapes}; nd-SBPs {sbps})")]
    Shape {
        op: &'static str,
        shapes: String,
        sbps: String,
        detail: String,
    },
    /// Operand dtypes do not fit the op.
    #[error(
        "{op}: dtype error: {detail} (input dtypes {dtypes}; shapes {shapes}; nd-SBPs {sbps})"
    )]
    DType {
        op: &'static str,
        dtypes: String,
        shapes: String,
        sbps: String,
        detail: String,
    },
    /// Global operands live on different placements (move one with `to_global` first).
    #[error("{op}: operands are on different placements {placements} (shapes {shapes}; nd-SBPs {sbps}); move one with to_global(&placement, sbp) first")]
    Placement {
        op: &'static str,
        placements: String,
        shapes: String,
        sbps: String,
    },
    /// An nd-SBP does not fit its placement or shape.
    #[error("{op}: SBP error: {detail} (shapes {shapes}; nd-SBPs {sbps}; placement {placement})")]
    Sbp {
        op: &'static str,
        shapes: String,
        sbps: String,
        placement: String,
        detail: String,
    },
    /// Local and global operands mixed in one op.
    #[error("{op}: cannot mix local and global operands (operand kinds {kinds}; shapes {shapes}); turn the local one into a global tensor with to_global first")]
    Mixed {
        op: &'static str,
        kinds: String,
        shapes: String,
    },
    /// Operands on different device types, or a device without a registered backend.
    #[error("{op}: device error: {detail} (devices {devices}; shapes {shapes})")]
    Device {
        op: &'static str,
        devices: String,
        shapes: String,
        detail: String,
    },
    /// An op needs a runtime context (world communicator) and none is installed.
    #[error("{op}: no runtime context: install one with Context::install (per thread) or init_from_env() (process)")]
    NoContext { op: &'static str },
    /// The placement names ranks outside the context's world.
    #[error("{op}: placement {placement} does not fit the world of {world_size} ranks: {detail}")]
    World {
        op: &'static str,
        placement: String,
        world_size: usize,
        detail: String,
    },
    /// The ranks disagree about metadata (found by `to_global_checked`).
    #[error("{op}: ranks disagree: {detail}")]
    Mismatch { op: &'static str, detail: String },
    /// Boxing failed (planning or executing a transition).
    #[error("{op}: boxing {from} -> {to} failed: {detail}")]
    Boxing {
        op: &'static str,
        from: String,
        to: String,
        detail: String,
    },
    /// A collective failed.
    #[error("{op}: communication failed: {source}")]
    Comm {
        op: &'static str,
        #[source]
        source: oxiflow_collectives::CommError,
    },
    /// An op has no kernel for the call's backend or input dtypes (raised from metadata before
    /// any communication, so every rank raises it alike).
    #[error("{op}: no kernel for this op on backend {backend} for input dtypes {dtypes} (its kernels: {available})")]
    NoKernel {
        op: &'static str,
        backend: &'static str,
        dtypes: String,
        available: String,
    },
    /// A kernel found bad data (e.g. an index out of range).
    #[error("{op}: {detail}")]
    Kernel { op: &'static str, detail: String },
    /// Autograd could not differentiate a graph (no gradient path, unsupported op, ...).
    #[error("{op}: cannot capture this step: {detail}")]
    Capture { op: &'static str, detail: String },
    #[error("{op}: autograd: {detail}")]
    Autograd { op: &'static str, detail: String },
    /// Saving or loading a checkpoint failed (I/O, format, missing tensors, layouts).
    #[error("{op}: checkpoint {path}: {detail}")]
    Checkpoint {
        op: &'static str,
        path: String,
        detail: String,
    },
}

pub type Result<T> = std::result::Result<T, TensorError>;
