//! Which checkpoint a load reads: `<path>` when it is complete (its manifest parses, its
//! checksum matches, every file and piece verifies), else `<path>.old` when that is complete
//! (the recovery rule: a save crashed between its renames, or `<path>` was damaged), with a
//! warning naming both paths and why; and the newest complete checkpoint of a directory, for
//! `--resume auto`.

use std::path::{Path, PathBuf};

use crate::Result;

use super::manifest::MANIFEST;
use super::manifest::{Manifest, MAX_MANIFEST_BYTES};
use super::paths::sibling;
use super::verify::{bad, read_regular, verify};

/// A complete checkpoint: its directory and manifest, and, when it is `<path>.old` standing in
/// for the requested `<path>`, why.
pub(crate) struct Verified {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub fell_back: Option<String>,
}

/// Reads, validates and verifies the checkpoint in exactly `dir`.
fn open_verified(dir: &Path) -> Result<Manifest> {
    match std::fs::symlink_metadata(dir) {
        Err(_) => return Err(bad(dir, "no complete checkpoint: nothing at this path")),
        Ok(m) if !m.is_dir() => {
            return Err(bad(
                dir,
                "not a checkpoint: not a plain directory (symlinks are not followed)",
            ))
        }
        Ok(_) => {}
    }
    let file = dir.join(MANIFEST);
    if std::fs::symlink_metadata(&file).is_err() {
        return Err(bad(dir, "no complete checkpoint: no manifest.json here"));
    }
    let text = read_regular(&file, MAX_MANIFEST_BYTES)?;
    let manifest = Manifest::parse(&text).map_err(|e| bad(&file, e))?;
    verify(dir, &manifest)?;
    Ok(manifest)
}

/// The checkpoint a load of `path` reads (see the module docs).
pub(crate) fn locate(path: &Path) -> Result<Verified> {
    let first = match open_verified(path) {
        Ok(manifest) => {
            return Ok(Verified {
                dir: path.to_path_buf(),
                manifest,
                fell_back: None,
            })
        }
        Err(e) => e,
    };
    let old = sibling(path, ".old");
    if std::fs::symlink_metadata(&old).is_err() {
        return Err(first);
    }
    match open_verified(&old) {
        Ok(manifest) => {
            let why = if std::fs::symlink_metadata(path).is_err() {
                format!(
                    "{} does not exist (a save was interrupted between its renames)",
                    path.display()
                )
            } else {
                format!("{} is not loadable: {first}", path.display())
            };
            let note = format!(
                "{why}; loading the previous checkpoint {} (step {}) instead",
                old.display(),
                manifest.step()
            );
            tracing::warn!("checkpoint: {note}");
            Ok(Verified {
                dir: old,
                manifest,
                fell_back: Some(note),
            })
        }
        Err(e) => Err(bad(
            path,
            format!("{first}; and the previous checkpoint is not loadable either: {e}"),
        )),
    }
}

/// The checkpoints `dir` may hold: itself and `<dir>.old` when either carries a manifest (a
/// checkpoint saved at `dir`), else its subdirectories with a manifest (a directory of
/// checkpoints; `.partial` saves are never candidates).
fn candidates(dir: &Path) -> Result<Vec<PathBuf>> {
    let old = sibling(dir, ".old");
    let flat: Vec<PathBuf> = [dir.to_path_buf(), old]
        .into_iter()
        .filter(|d| std::fs::symlink_metadata(d.join(MANIFEST)).is_ok())
        .collect();
    if !flat.is_empty() {
        return Ok(flat);
    }
    let meta = match std::fs::symlink_metadata(dir) {
        Err(_) => return Ok(Vec::new()),
        Ok(m) => m,
    };
    if !meta.is_dir() {
        return Err(bad(
            dir,
            "not a checkpoint directory: not a plain directory (symlinks are not followed)",
        ));
    }
    let entries = std::fs::read_dir(dir).map_err(|e| bad(dir, format!("listing it: {e}")))?;
    let mut found = Vec::new();
    for e in entries {
        let e = e.map_err(|e| bad(dir, format!("listing it: {e}")))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let is_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        if is_dir
            && !name.starts_with('.')
            && !name.ends_with(".partial")
            && std::fs::symlink_metadata(path.join(MANIFEST)).is_ok()
        {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// The newest complete checkpoint in `dir` (see `candidates`): of those whose manifest and
/// every piece verify, the one with the highest `step` (ties: `dir` before `<dir>.old`, then
/// by name). `Ok(None)` when `dir` holds no checkpoint at all (nothing there, or only a save
/// that never published), so a first start begins fresh; an error naming each one and why when
/// checkpoints exist but none is complete (a run never silently starts over). Skipping a
/// damaged checkpoint for an older one is logged as a warning.
pub fn newest_complete(dir: &Path) -> Result<Option<PathBuf>> {
    let mut best: Option<(u64, PathBuf)> = None;
    let mut damaged: Vec<String> = Vec::new();
    for c in candidates(dir)? {
        match open_verified(&c) {
            Ok(m) => {
                let step = m.step();
                if best.as_ref().is_none_or(|(s, _)| step > *s) {
                    best = Some((step, c));
                }
            }
            Err(e) => damaged.push(e.to_string()),
        }
    }
    match best {
        Some((step, path)) => {
            for d in &damaged {
                tracing::warn!(
                    "checkpoint: skipping a damaged checkpoint ({d}); the newest complete one is \
                     {} (step {step})",
                    path.display()
                );
            }
            Ok(Some(path))
        }
        None if damaged.is_empty() => Ok(None),
        None => Err(bad(
            dir,
            format!(
                "holds checkpoints but none is complete: {}",
                damaged.join("; ")
            ),
        )),
    }
}
