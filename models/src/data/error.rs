//! `DataError`: why a corpus could not be read or used.

use std::path::PathBuf;

/// A corpus that cannot be read, parsed or sampled from.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{op}: cannot read {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{op}: {path}: {detail}")]
    Format {
        op: &'static str,
        path: PathBuf,
        detail: String,
    },
    #[error("{op}: {detail}")]
    Sampling { op: &'static str, detail: String },
}
