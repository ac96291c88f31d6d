//! Paths beside a checkpoint and the error of a failed file operation on one.

use std::path::{Path, PathBuf};

use crate::TensorError;

/// The checkpoint error of file operation `op` on `path` failing with `e`.
pub(crate) fn io_err(op: &'static str, path: &Path, e: impl std::fmt::Display) -> TensorError {
    TensorError::Checkpoint {
        op,
        path: path.display().to_string(),
        detail: e.to_string(),
    }
}

/// `<path><suffix>` (a sibling of the checkpoint directory).
pub(crate) fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The folder `path` is in (`.` for a bare name).
pub(crate) fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
