//! Crash safety on the file system: files written to a temp name, fsynced and renamed; the
//! checkpoint directory built under `<path>.partial` and renamed into place; the recovery rule;
//! and the rule that a save never removes or replaces anything that is not a checkpoint.
//!
//! A checkpoint directory is valid when it holds `manifest.json` (written last) naming the
//! oxiflow format. Publishing is: rename `<path>` (if any) to `<path>.old`, rename
//! `<path>.partial` to `<path>`, fsync the parent, remove `<path>.old`. Recovery rule (before
//! every save): if `<path>` does not exist and `<path>.old` is a checkpoint, the crash hit
//! between the two renames and `<path>.old` is the checkpoint (it is renamed back). A load
//! applies the same rule read-only (see `locate`).
//! `<path>.partial` is never loaded; it carries a marker file (until its manifest is written) so
//! that only a directory this module made is ever removed as a stale partial.
//!
//! A save that fails removes its `<path>.partial`.
//!
//! A save refuses (before anything is written) a `<path>` that exists and is not a checkpoint
//! (a file, or a directory without our manifest), and a `<path>.old` or `<path>.partial` that is
//! not ours and not empty, so user data at those names is never deleted. (Another save's
//! `<path>.partial` or `<path>.old` is empty for a moment while it is made or removed.)

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::Result;

use super::limits::{check_file_size, write_error};
use super::manifest::MANIFEST;
use super::paths::{io_err, parent_of, sibling};
use super::SaveStage;

/// The file that marks a `<path>.partial` directory as made by a save.
const PARTIAL_MARKER: &str = ".oxiflow-partial";

/// Whether `dir` is a checkpoint of ours: a directory (not a symlink) whose `manifest.json` is a
/// regular file naming the oxiflow format. Only the format field is read here; `load` validates
/// the whole manifest.
pub(crate) fn has_manifest(dir: &Path) -> bool {
    let is_dir = fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir());
    let manifest = dir.join(MANIFEST);
    let is_file = fs::symlink_metadata(&manifest)
        .is_ok_and(|m| m.is_file() && m.len() <= super::manifest::MAX_MANIFEST_BYTES);
    if !(is_dir && is_file) {
        return false;
    }
    #[derive(serde::Deserialize)]
    struct Format {
        format: String,
    }
    fs::read(&manifest)
        .ok()
        .and_then(|b| serde_json::from_slice::<Format>(&b).ok())
        .is_some_and(|f| f.format == super::manifest::FORMAT)
}

/// Whether anything (a file, directory or symlink, even a dangling one) exists at `path`.
fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// Refuses a save to `path` when `path`, `<path>.old` or `<path>.partial` holds something that
/// is not ours. Read-only, so every rank can run it before the save's first barrier (and a
/// training job before its first step). It takes no lock, so another save may publish (rename
/// and remove those names) while it looks: a name is refused only when it looks foreign on
/// [`LOOKS`] looks a few milliseconds apart (user data stays put; another save's moves end in
/// microseconds).
pub fn check_save_target(path: &Path) -> Result<()> {
    let mut verdict = foreign_at(path);
    for _ in 1..LOOKS {
        if verdict.is_none() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
        verdict = foreign_at(path);
    }
    match verdict {
        None => Ok(()),
        Some((p, what)) => Err(io_err(
            "checkpoint save",
            &p,
            format!("{what}; refusing to replace it (choose another path or remove it)"),
        )),
    }
}

/// How many times [`check_save_target`] looks before it refuses a name.
const LOOKS: usize = 4;

/// The first of `path`, `<path>.old` and `<path>.partial` that holds something not ours, and
/// what, as one look sees them.
fn foreign_at(path: &Path) -> Option<(PathBuf, &'static str)> {
    if exists(path) && !has_manifest(path) {
        let kind = fs::symlink_metadata(path).map(|m| m.file_type());
        return match kind {
            Ok(k) if k.is_dir() => Some((
                path.to_path_buf(),
                "exists and is not an oxiflow checkpoint (no oxiflow manifest.json)",
            )),
            Ok(_) => Some((path.to_path_buf(), "exists and is not a directory")),
            // Gone since: another save's rename.
            Err(_) => None,
        };
    }
    let old = sibling(path, ".old");
    if exists(&old) && !has_manifest(&old) && !is_empty_dir(&old) && exists(&old) {
        return Some((old, "exists and is not an oxiflow checkpoint"));
    }
    let partial = sibling(path, ".partial");
    if exists(&partial) && !is_our_partial(&partial) && exists(&partial) {
        return Some((partial, "exists and is not a partial save of oxiflow"));
    }
    None
}

/// A `<path>.partial` made by a save: it carries the marker, or (once complete) our manifest,
/// or it is empty (another save between making it and marking it, or between removing its
/// last file and itself: removing an empty directory loses nothing).
fn is_our_partial(dir: &Path) -> bool {
    let marked = fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir())
        && fs::symlink_metadata(dir.join(PARTIAL_MARKER)).is_ok_and(|m| m.is_file());
    marked || has_manifest(dir) || is_empty_dir(dir)
}

/// Whether `dir` is a directory (not a symlink) with nothing in it.
fn is_empty_dir(dir: &Path) -> bool {
    fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir())
        && fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none())
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("checkpoint fsync", dir, e))
}

/// Writes `bytes` to `path` atomically: `<path>.tmp`, fsync, rename, fsync of the directory.
/// A file over the file-size limit is refused before anything is written; a failed write
/// names the limit or the free space it hit. `hook` sees `SaveStage::MidFile` after half of
/// the bytes are written.
pub(crate) fn write_file(path: &Path, bytes: &[u8], hook: &dyn Fn(SaveStage)) -> Result<()> {
    let tmp = sibling(path, ".tmp");
    let len = bytes.len() as u64;
    check_file_size(path, len)?;
    let mut f = File::create(&tmp).map_err(|e| write_error(&tmp, len, e))?;
    let half = bytes.len() / 2;
    f.write_all(&bytes[..half])
        .map_err(|e| write_error(&tmp, len, e))?;
    f.flush().map_err(|e| write_error(&tmp, len, e))?;
    hook(SaveStage::MidFile);
    f.write_all(&bytes[half..])
        .map_err(|e| write_error(&tmp, len, e))?;
    f.sync_all().map_err(|e| write_error(&tmp, len, e))?;
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
        if exists(path) {
            return Err(io_err(
                "checkpoint recover",
                path,
                "exists and is not an oxiflow checkpoint while <path>.old is one; refusing to replace it",
            ));
        }
        fs::rename(&old, path).map_err(|e| io_err("checkpoint recover", path, e))?;
        fsync_dir(&parent_of(path))?;
        return Ok(Some(path.to_path_buf()));
    }
    Ok(None)
}

/// Makes an empty `<path>.partial` (removing a stale one) and returns it.
pub(crate) fn fresh_partial(path: &Path) -> Result<PathBuf> {
    let partial = sibling(path, ".partial");
    if exists(&partial) {
        if !is_our_partial(&partial) {
            return Err(io_err(
                "checkpoint save",
                &partial,
                "exists and is not a partial save of oxiflow; refusing to remove it",
            ));
        }
        remove_ours(&partial).map_err(|e| io_err("checkpoint save", &partial, e))?;
    }
    fs::create_dir_all(&partial).map_err(|e| io_err("checkpoint save", &partial, e))?;
    File::create(partial.join(PARTIAL_MARKER))
        .map_err(|e| io_err("checkpoint save", &partial, e))?;
    Ok(partial)
}

/// Removes `<path>.partial` after a failed save, when it is ours (a failure to remove it is
/// logged: the next save removes it).
pub(crate) fn remove_partial(path: &Path) {
    let partial = sibling(path, ".partial");
    if exists(&partial) && is_our_partial(&partial) {
        if let Err(e) = remove_ours(&partial) {
            tracing::warn!(
                "checkpoint save: cannot remove {} after the failed save: {e}",
                partial.display()
            );
        }
    }
}

/// Publishes a complete `<path>.partial` as `<path>` (see the module docs).
pub(crate) fn publish(path: &Path, hook: &dyn Fn(SaveStage)) -> Result<()> {
    let partial = sibling(path, ".partial");
    let old = sibling(path, ".old");
    check_save_target(path)?;
    fs::remove_file(partial.join(PARTIAL_MARKER))
        .map_err(|e| io_err("checkpoint publish", &partial, e))?;
    fsync_dir(&partial)?;
    hook(SaveStage::BeforePublish);
    if exists(&old) {
        remove_ours(&old).map_err(|e| io_err("checkpoint publish", &old, e))?;
    }
    let had_old = exists(path);
    if had_old {
        fs::rename(path, &old).map_err(|e| io_err("checkpoint publish", path, e))?;
        hook(SaveStage::BetweenRenames);
    }
    fs::rename(&partial, path).map_err(|e| io_err("checkpoint publish", path, e))?;
    fsync_dir(&parent_of(path))?;
    if had_old {
        remove_ours(&old).map_err(|e| io_err("checkpoint publish", &old, e))?;
    }
    Ok(())
}

/// Removes a directory this module made (a checkpoint or a partial save) so that a process
/// killed part way leaves it still recognisable as ours: every entry but the manifest and the
/// partial marker first, then those, then the directory. (`remove_dir_all` may take the
/// manifest first, and a checkpoint left without it would be refused as not ours.)
fn remove_ours(dir: &Path) -> std::io::Result<()> {
    let last = [MANIFEST, PARTIAL_MARKER];
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if last.iter().any(|n| entry.file_name() == *n) {
            continue;
        }
        if entry.file_type()?.is_dir() {
            fs::remove_dir_all(entry.path())?;
        } else {
            fs::remove_file(entry.path())?;
        }
    }
    for name in last {
        match fs::remove_file(dir.join(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    fs::remove_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("oxiflow-atomic-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn checkpoint_dir(dir: &Path, files: &[&str]) {
        fs::create_dir_all(dir.join("sub")).unwrap();
        for f in files {
            fs::write(dir.join(f), b"data").unwrap();
        }
        fs::write(dir.join("sub/nested"), b"data").unwrap();
        let manifest = format!("{{\"format\": \"{}\"}}", super::super::manifest::FORMAT);
        fs::write(dir.join(MANIFEST), manifest).unwrap();
    }

    #[test]
    fn removal_keeps_the_manifest_until_last_and_a_part_removed_old_is_still_ours() {
        let root = scratch("remove");
        let dir = root.join("ckpt.old");
        checkpoint_dir(&dir, &["rank-00000.safetensors", "rank-00001.safetensors"]);
        // What a save killed part way through removing `<path>.old` leaves: the manifest and
        // some of the files.
        fs::remove_file(dir.join("rank-00000.safetensors")).unwrap();
        assert!(has_manifest(&dir));
        assert!(check_save_target(&root.join("ckpt")).is_ok());
        remove_ours(&dir).unwrap();
        assert!(!exists(&dir));
        // A partial save's marker also stays until last.
        let partial = root.join("ckpt.partial");
        fs::create_dir_all(&partial).unwrap();
        fs::write(partial.join(PARTIAL_MARKER), b"").unwrap();
        fs::write(partial.join("rank-00000.safetensors"), b"data").unwrap();
        remove_ours(&partial).unwrap();
        assert!(!exists(&partial));
        // An empty `.partial` or `.old` (another save between making and marking it, or
        // removing it) is ours; a non-empty unmarked one is refused.
        fs::create_dir_all(&partial).unwrap();
        fs::create_dir_all(&dir).unwrap();
        assert!(check_save_target(&root.join("ckpt")).is_ok());
        fs::write(partial.join("user-file"), b"data").unwrap();
        assert!(check_save_target(&root.join("ckpt")).is_err());
        let _ = fs::remove_dir_all(root);
    }
}
