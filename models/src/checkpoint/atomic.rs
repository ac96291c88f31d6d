//! Crash safety on the file system: files written to a temp name, fsynced and renamed; the
//! checkpoint directory built under `<path>.partial` and renamed into place; the recovery rule.
//!
//! A checkpoint directory is valid when it holds `manifest.json`, which is written last.
//! Publishing is: rename `<path>` (if any) to `<path>.old`, rename `<path>.partial` to `<path>`,
//! fsync the parent, remove `<path>.old`. Recovery rule (on load and before every save): if
//! `<path>` has no manifest and `<path>.old` has one, the crash hit between the two renames and
//! `<path>.old` is the checkpoint (it is renamed back). `<path>.partial` is never loaded.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Result, TensorError};

use super::SaveStage;

pub(crate) const MANIFEST: &str = "manifest.json";

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

pub(crate) fn has_manifest(dir: &Path) -> bool {
    dir.join(MANIFEST).is_file()
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("checkpoint fsync", dir, e))
}

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Writes `bytes` to `path` atomically: `<path>.tmp`, fsync, rename, fsync of the directory.
/// `hook` sees `SaveStage::MidFile` after half of the bytes are written.
pub(crate) fn write_file(path: &Path, bytes: &[u8], hook: &dyn Fn(SaveStage)) -> Result<()> {
    let tmp = sibling(path, ".tmp");
    let mut f = File::create(&tmp).map_err(|e| io_err("checkpoint write", &tmp, e))?;
    let half = bytes.len() / 2;
    f.write_all(&bytes[..half])
        .map_err(|e| io_err("checkpoint write", &tmp, e))?;
    f.flush().map_err(|e| io_err("checkpoint write", &tmp, e))?;
    hook(SaveStage::MidFile);
    f.write_all(&bytes[half..])
        .map_err(|e| io_err("checkpoint write", &tmp, e))?;
    f.sync_all()
        .map_err(|e| io_err("checkpoint fsync", &tmp, e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| io_err("checkpoint rename", path, e))?;
    fsync_dir(&parent_of(path))
}

/// Applies the recovery rule to `path` (see the module docs). Returns the valid directory, if any.
pub(crate) fn recover(path: &Path) -> Result<Option<PathBuf>> {
    if has_manifest(path) {
        return Ok(Some(path.to_path_buf()));
    }
    let old = sibling(path, ".old");
    if has_manifest(&old) {
        if path.exists() {
            fs::remove_dir_all(path).map_err(|e| io_err("checkpoint recover", path, e))?;
        }
        fs::rename(&old, path).map_err(|e| io_err("checkpoint recover", path, e))?;
        fsync_dir(&parent_of(path))?;
        return Ok(Some(path.to_path_buf()));
    }
    Ok(None)
}

/// The directory to load from without touching the file system (recovery rule, read-only).
pub(crate) fn resolve_for_load(path: &Path) -> Option<PathBuf> {
    if has_manifest(path) {
        return Some(path.to_path_buf());
    }
    let old = sibling(path, ".old");
    has_manifest(&old).then_some(old)
}

/// Makes an empty `<path>.partial` (removing a stale one) and returns it.
pub(crate) fn fresh_partial(path: &Path) -> Result<PathBuf> {
    let partial = sibling(path, ".partial");
    if partial.exists() {
        fs::remove_dir_all(&partial).map_err(|e| io_err("checkpoint save", &partial, e))?;
    }
    fs::create_dir_all(&partial).map_err(|e| io_err("checkpoint save", &partial, e))?;
    Ok(partial)
}

/// Publishes a complete `<path>.partial` as `<path>` (see the module docs).
pub(crate) fn publish(path: &Path, hook: &dyn Fn(SaveStage)) -> Result<()> {
    let partial = sibling(path, ".partial");
    let old = sibling(path, ".old");
    fsync_dir(&partial)?;
    hook(SaveStage::BeforePublish);
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io_err("checkpoint publish", &old, e))?;
    }
    let had_old = path.exists();
    if had_old {
        fs::rename(path, &old).map_err(|e| io_err("checkpoint publish", path, e))?;
        hook(SaveStage::BetweenRenames);
    }
    fs::rename(&partial, path).map_err(|e| io_err("checkpoint publish", path, e))?;
    fsync_dir(&parent_of(path))?;
    if had_old {
        fs::remove_dir_all(&old).map_err(|e| io_err("checkpoint publish", &old, e))?;
    }
    Ok(())
}
