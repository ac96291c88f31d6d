//! The process and file-system limits a save can hit, named in its errors: a file larger than
//! the file-size limit (`ulimit -f`, RLIMIT_FSIZE) is refused before a byte is written (so the
//! kernel never kills the rank with SIGXFSZ mid-save), and a write that fails for space
//! (ENOSPC, EDQUOT) or size (EFBIG) says how much was needed and what the limit or the free
//! space is.

use std::path::Path;

use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};

use crate::TensorError;

use super::paths::{io_err, parent_of};

/// The soft file-size limit of this process in bytes; None when unlimited or unknown.
fn file_size_limit() -> Option<u64> {
    getrlimit(Resource::RLIMIT_FSIZE)
        .ok()
        .map(|(soft, _)| soft)
        .filter(|&soft| soft != RLIM_INFINITY)
}

fn size_limit_detail(len: u64, limit: u64) -> String {
    format!(
        "{len} bytes exceed this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) of \
         {limit} bytes; raise the limit or save elsewhere"
    )
}

/// Refuses to write `len` bytes to `path` when they exceed the file-size limit.
pub(crate) fn check_file_size(path: &Path, len: u64) -> Result<(), TensorError> {
    match file_size_limit() {
        Some(limit) if len > limit => Err(io_err(
            "checkpoint write",
            path,
            size_limit_detail(len, limit),
        )),
        _ => Ok(()),
    }
}

/// The bytes available to this user on the file system holding `dir`.
fn available_bytes(dir: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    Some((s.blocks_available() as u64).saturating_mul(s.fragment_size() as u64))
}

/// The error of a failed write of `len` bytes to `path`, naming the limit it hit when it is a
/// size or space error.
pub(crate) fn write_error(path: &Path, len: u64, e: std::io::Error) -> TensorError {
    let detail = match e.raw_os_error() {
        Some(code) if code == nix::libc::ENOSPC || code == nix::libc::EDQUOT => {
            let free = available_bytes(&parent_of(path))
                .map_or_else(|| "unknown".to_string(), |b| b.to_string());
            format!(
                "{e}: {len} bytes to write, {free} bytes available on the file system of {}",
                parent_of(path).display()
            )
        }
        Some(nix::libc::EFBIG) => match file_size_limit() {
            Some(limit) => format!("{e}: {}", size_limit_detail(len, limit)),
            None => format!("{e}: {len} bytes exceed the file system's largest file"),
        },
        _ => e.to_string(),
    };
    io_err("checkpoint write", path, detail)
}
