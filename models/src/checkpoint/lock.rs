//! The save lock: rank 0 of a save holds an exclusive `flock` on `<path>.lock` from before it
//! prepares `<path>.partial` until the save is published or cleaned up, so two jobs saving to
//! one path take turns (the second waits, up to a bound, then fails naming the holder) and
//! neither removes or publishes the other's files. The holder unlinks the lock file before
//! releasing it; a waiter that then gets the lock on the unlinked file sees that the path no
//! longer names it and tries again, so no two processes ever hold "the" lock at once. The lock
//! dies with its process (the kernel releases it), so a crashed save never blocks the next.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::Result;

use super::atomic::{io_err, parent_of, sibling};

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
                    let _ = file
                        .set_len(0)
                        .and_then(|()| writeln!(file, "pid {}", std::process::id()));
                    return Ok(SaveLock { file, path });
                }
                Err(fs::TryLockError::WouldBlock) => {
                    if start.elapsed() >= wait {
                        let holder = fs::read_to_string(&path)
                            .ok()
                            .map(|s| s.trim().to_string())
                            .filter(|s| !s.is_empty())
                            .unwrap_or_else(|| "another process".into());
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
