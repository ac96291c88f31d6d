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
    #[error("tokenizer {name}: {detail}")]
    Tokenizer { name: &'static str, detail: String },
    /// A tokenizer.json (or the tokenizer_config.json beside it) that cannot be used.
    #[error("tokenizer {path}: {detail}")]
    TokenizerFile { path: PathBuf, detail: String },
    /// A token shard that cannot be used: `offset` is the byte offset in `path` where the
    /// problem is.
    #[error("{path} at byte {offset}: {detail}")]
    Shard {
        path: PathBuf,
        offset: u64,
        detail: String,
    },
    #[error("{what} {pattern:?}: {detail}")]
    Glob {
        what: &'static str,
        pattern: String,
        detail: String,
    },
}
