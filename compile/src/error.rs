//! The crate's one error type.

use oxiflow_tensor::TensorError;

/// Why a step could not be compiled or replayed.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The step read a device value on the host (`op`, e.g. `to_ndarray`): its result depends
    /// on data the program cannot see, so it cannot be replayed. Every rank runs the same step,
    /// so every rank fails alike, before the read communicates.
    #[error("{op}: a compiled step cannot read a tensor's value on the host ({tensor}); pass host values in as step inputs or read them after the step")]
    HostRead { op: &'static str, tensor: String },
    /// The step made a tensor from host data (`op`, e.g. `from_array`): a replay would see
    /// the capture's data, so such a tensor must be a step input.
    #[error("{op}: a compiled step cannot make a tensor from host data ({tensor}); make it before the step and pass it in as a step input")]
    HostData { op: &'static str, tensor: String },
    /// The step ran an extern op whose kernels cannot be replayed from a recording
    /// (`ExternOp::replay_refusal`): every rank runs the same step, so every rank refuses alike.
    #[error("{op}: a compiled step cannot replay this op: {why}")]
    Unreplayable { op: &'static str, why: String },
    /// The inputs of a replay do not fit the program (the caller's bug).
    #[error("replay of a compiled step: {detail}")]
    Inputs { detail: String },
    /// A node of the program failed on replay.
    #[error("replay of a compiled step: node {node} ({op}): {detail}")]
    Replay {
        node: usize,
        op: &'static str,
        detail: String,
    },
    /// An op, boxing or collective failed (while capturing or replaying).
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

pub type Result<T> = std::result::Result<T, CompileError>;
