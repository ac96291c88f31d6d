//! Typed errors of the communicators, the rendezvous store and environment discovery.

use std::time::Duration;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CommError {
    #[error("{op}: timed out after {timeout:?} waiting for rank(s) {missing:?}")]
    Timeout {
        op: String,
        timeout: Duration,
        missing: Vec<usize>,
    },
    #[error("{op}: lost rank {rank}: {detail}")]
    PeerLost {
        op: String,
        rank: usize,
        detail: String,
    },
    #[error("{op}: buffer of {got} bytes, expected {expected} bytes ({detail})")]
    BufferSize {
        op: String,
        expected: usize,
        got: usize,
        detail: String,
    },
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument { op: String, detail: String },
    #[error("{op}: ranks disagree: {detail}")]
    Mismatch { op: String, detail: String },
    #[error("{op} is not supported by the {backend} backend: {detail}")]
    Unsupported {
        op: String,
        backend: String,
        detail: String,
    },
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A rendezvous-store wait that ran out of time; `missing_keys` lists the keys (or barrier
    /// members) still absent, `detail` says what had arrived.
    #[error("{op}: timed out after {timeout:?}: {detail}")]
    StoreTimeout {
        op: String,
        timeout: Duration,
        missing_keys: Vec<String>,
        detail: String,
    },
    #[error("rendezvous refused the connection: {0}")]
    Unauthenticated(String),
    #[error("launch environment: {0}")]
    Env(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("device library: {0}")]
    Device(String),
}
