//! Where `--save` puts checkpoints: one checkpoint at `PATH` (each save replaces the last), or
//! a folder of checkpoints (`--save DIR/` with a trailing slash, or an existing folder that
//! holds checkpoints or nothing yet): each save a new `DIR/step-00000100` beside the earlier
//! ones, with its configuration in `DIR/step-00000100.config.toml`, and `--resume auto` takes
//! the one of the highest step.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The two forms of `--save` (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaveTarget {
    One(PathBuf),
    Folder(PathBuf),
}

/// Whether `dir` is a plain folder (not a symlink) that is not itself a checkpoint and holds
/// checkpoints (folders with a manifest) or nothing.
fn folder_of_checkpoints(dir: &Path) -> bool {
    let plain = std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir());
    if !plain || dir.join("manifest.json").exists() {
        return false;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut empty = true;
    for e in entries.flatten() {
        empty = false;
        if e.path().join("manifest.json").is_file() {
            return true;
        }
    }
    empty
}

impl SaveTarget {
    /// The form `--save save` names, as the file system is now.
    pub fn of(save: &Path) -> SaveTarget {
        let bytes = save.as_os_str().as_bytes();
        let trailing = bytes.len() > 1 && bytes.ends_with(b"/");
        let mut end = bytes.len();
        while end > 1 && bytes[end - 1] == b'/' {
            end -= 1;
        }
        let path = PathBuf::from(std::ffi::OsStr::from_bytes(&bytes[..end]));
        if trailing || folder_of_checkpoints(&path) {
            SaveTarget::Folder(path)
        } else {
            SaveTarget::One(path)
        }
    }

    /// The path `--save` names (the checkpoint, or the folder of checkpoints).
    pub fn path(&self) -> &Path {
        match self {
            SaveTarget::One(p) | SaveTarget::Folder(p) => p,
        }
    }

    /// The checkpoint a save at `step` writes.
    pub fn at(&self, step: u64) -> PathBuf {
        match self {
            SaveTarget::One(p) => p.clone(),
            SaveTarget::Folder(d) => d.join(format!("step-{step:08}")),
        }
    }
}
