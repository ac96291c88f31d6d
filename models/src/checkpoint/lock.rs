//! The job lock: a training job holds an exclusive `flock` on `<path>.job.lock` for its whole
//! life, taken before its first step and never waited for, so a second job saving to the same
//! path is refused at once, naming the holder's pid and host, instead of the two replacing each
//! other's checkpoints.
//!
//! The save lock: rank 0 of a save holds an exclusive `flock` on `<path>.lock` from before it
//! prepares `<path>.partial` until the save is published or cleaned up, so two jobs saving to
//! one path take turns (the second waits, up to a bound, then fails naming the holder) and
//! neither removes or publishes the other's files. The holder unlinks the lock file before
//! releasing it; a waiter that then gets the lock on the unlinked file sees that the path no
//! longer names it and tries again, so no two processes ever hold "the" lock at once. The lock
//! dies with its process (the kernel releases it), so a crashed save never blocks the next.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::Result;

use super::paths::{io_err, parent_of, sibling};

/// How long a save waits for another save of the same path when `SaveOptions::lock_wait` is
/// not set.
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(60);
/// How often a waiting save tries the lock again.
const RETRY: Duration = Duration::from_millis(50);

/// A held save lock; released (and its file removed) on drop.
pub(crate) struct SaveLock {
    file: File,
    path: PathBuf,
}

fn open_lock_file(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            io_err(
                "checkpoint save",
                path,
                format!("cannot open the save lock (a regular file, never a symlink): {e}"),
            )
        })
}

/// Who holds a lock: this process's pid and host.
fn holder_line() -> String {
    let host = fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "an unknown host".into());
    format!("pid {} on host {host}", std::process::id())
}

/// What the lock file at `path` says of its holder (which writes it just after locking: an
/// empty file is read again for a moment).
fn holder_of(path: &Path) -> String {
    let start = Instant::now();
    loop {
        let said = fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty());
        match said {
            Some(s) => return s,
            None if start.elapsed() < Duration::from_millis(500) => std::thread::sleep(RETRY),
            None => return "another process".into(),
        }
    }
}

/// Writes who holds `file` (after checking that it is a lock file: empty, or one of ours).
fn claim(file: &mut File, path: &Path) -> Result<()> {
    let mut old = String::new();
    let _ = (&mut *file).take(4096).read_to_string(&mut old);
    if !old.is_empty() && !old.starts_with("pid ") {
        return Err(io_err(
            "checkpoint save",
            path,
            "exists and is not a lock file of oxiflow; refusing to write over it (remove it or \
             save elsewhere)",
        ));
    }
    let _ = file
        .set_len(0)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .and_then(|_| writeln!(file, "{}", holder_line()));
    Ok(())
}

/// A job's hold on its save path (see the module docs); released (and its file removed) on
/// drop.
pub struct JobLock {
    _lock: SaveLock,
}

impl JobLock {
    /// Takes the job lock of saves to `target`, or fails at once naming its live holder.
    pub fn hold(target: &Path) -> Result<JobLock> {
        let path = sibling(target, ".job.lock");
        let parent = parent_of(target);
        fs::create_dir_all(&parent)
            .map_err(|e| io_err("checkpoint save", &parent, format!("creating it: {e}")))?;
        loop {
            let mut file = open_lock_file(&path)?;
            match file.try_lock() {
                Ok(()) if !still_at(&file, &path) => continue,
                Ok(()) => {
                    claim(&mut file, &path)?;
                    return Ok(JobLock {
                        _lock: SaveLock { file, path },
                    });
                }
                Err(fs::TryLockError::WouldBlock) => {
                    return Err(io_err(
                        "checkpoint save",
                        target,
                        format!(
                            "held by a live job ({}, in {}); two jobs saving to one path would \
                             replace each other's checkpoints: stop that job or save elsewhere",
                            holder_of(&path),
                            path.display()
                        ),
                    ))
                }
                Err(fs::TryLockError::Error(e)) => {
                    return Err(io_err("checkpoint save", &path, format!("locking: {e}")))
                }
            }
        }
    }
}

/// Whether `file` is still the file at `path`.
fn still_at(file: &File, path: &Path) -> bool {
    match (file.metadata(), fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

impl SaveLock {
    /// Takes the lock of a save to `target`, waiting up to `wait` for another holder.
    pub(crate) fn acquire(target: &Path, wait: Duration) -> Result<SaveLock> {
        let path = sibling(target, ".lock");
        let parent = parent_of(target);
        fs::create_dir_all(&parent)
            .map_err(|e| io_err("checkpoint save", &parent, format!("creating it: {e}")))?;
        let start = Instant::now();
        loop {
            let mut file = open_lock_file(&path)?;
            match file.try_lock() {
                Ok(()) => {
                    if !still_at(&file, &path) {
                        continue;
                    }
                    // Who holds it, for the message of a save that waits in vain.
                    claim(&mut file, &path)?;
                    return Ok(SaveLock { file, path });
                }
                Err(fs::TryLockError::WouldBlock) => {
                    if start.elapsed() >= wait {
                        let holder = holder_of(&path);
                        return Err(io_err(
                            "checkpoint save",
                            target,
                            format!(
                                "another save of this path holds {} ({holder}); waited {:.1} s \
                                 for it, refusing to write beside it",
                                path.display(),
                                start.elapsed().as_secs_f64()
                            ),
                        ));
                    }
                    std::thread::sleep(RETRY);
                }
                Err(fs::TryLockError::Error(e)) => {
                    return Err(io_err("checkpoint save", &path, format!("locking: {e}")))
                }
            }
        }
    }
}

impl Drop for SaveLock {
    fn drop(&mut self) {
        // Unlinked while still held (see the module docs); closing the file releases it.
        let _ = fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}
