//! `HfError`: why a Hugging Face model directory cannot be read into, or written from, a
//! decoder: each names the file and, where one is at fault, the tensor.

use std::path::PathBuf;

use oxiflow_tensor::TensorError;

/// A Hugging Face checkpoint that does not fit (found before any tensor is built from it).
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `config.json` names an architecture this crate does not build.
    #[error("{path}: architecture {found} is not supported (supported: {supported})")]
    Architecture {
        path: PathBuf,
        found: String,
        supported: String,
    },
    /// A `config.json` key is missing, of the wrong type, or has a value the model cannot
    /// take.
    #[error("{path}: {key}: {detail}")]
    Config {
        path: PathBuf,
        key: String,
        detail: String,
    },
    /// A file is not safetensors, or an index is not one.
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },
    /// The index names a file the directory does not have.
    #[error("{index}: tensor {tensor} is in {file}, which does not exist")]
    IndexMissingFile {
        index: PathBuf,
        file: String,
        tensor: String,
    },
    /// The model needs tensors the checkpoint does not hold.
    #[error("{path}: missing tensors {tensors:?}")]
    Missing { path: PathBuf, tensors: Vec<String> },
    /// The checkpoint holds tensors the model does not use.
    #[error("{path}: unexpected tensors {tensors:?}")]
    Unexpected { path: PathBuf, tensors: Vec<String> },
    /// A tensor of another shape than the configuration gives it.
    #[error("{path}: tensor {tensor} is {found:?}, the configuration needs {expected:?}")]
    Shape {
        path: PathBuf,
        tensor: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A tensor stored in a dtype that is not a float this crate reads.
    #[error("{path}: tensor {tensor} is stored as {dtype} (readable: F32, F64, BF16, F16)")]
    DType {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// The model built from the configuration does not fit the job.
    #[error("{path}: {detail}")]
    Model { path: PathBuf, detail: String },
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// The crate's results on Hugging Face directories.
pub type HfResult<T> = std::result::Result<T, HfError>;
