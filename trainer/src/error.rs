//! `TrainError`: why a training job could not start or stopped.

use std::path::PathBuf;

use oxiflow_models::data::DataError;
use oxiflow_models::hf::HfError;
use oxiflow_placement::PlacementError;
use oxiflow_tensor::TensorError;

/// A training job's failure.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A setting or combination of settings that cannot run (found before any tensor work).
    #[error("{detail}")]
    Config { detail: String },
    /// The job's layout does not fit the world or the model.
    #[error("{detail}")]
    Layout { detail: String },
    /// The mesh's axes do not fit each other or the world.
    #[error(transparent)]
    Mesh(#[from] PlacementError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A Hugging Face model directory that does not fit (`--from-hf`, `--save-hf`).
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error(transparent)]
    Comm(#[from] oxiflow_collectives::CommError),
    /// A compiled step (`--compile`) that could not be captured or replayed.
    #[error(transparent)]
    Compile(#[from] oxiflow_compile::CompileError),
    /// A checkpoint that does not belong to this run.
    #[error("--resume {path}: {detail}")]
    Resume { path: PathBuf, detail: String },
    /// A step whose loss or gradient norm is not finite (stopped before its update), or
    /// training state that is not finite where a checkpoint would be written.
    #[error("step {step}: {detail}")]
    NonFinite { step: u64, detail: String },
    /// The job would not fit in the memory of the host or the device (found before
    /// allocating it).
    #[error("{detail}")]
    Memory { detail: String },
    /// An output (metrics, plot, configuration) that could not be written.
    #[error("{what} {path}: {detail}")]
    Output {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },
}

impl TrainError {
    /// The exit status a program reports this error with: 2 for settings (as for flags the
    /// command line refuses), 3 for a run stopped by a non-finite loss or gradient, 1 for
    /// everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            TrainError::Config { .. } => 2,
            TrainError::NonFinite { .. } => 3,
            _ => 1,
        }
    }
}
