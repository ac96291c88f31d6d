//! How NCCL communicators meet: a key-value exchange for the unique id and a liveness check.
//!
//! The rendezvous store's client implements it for real jobs; [`FileExchange`] (a folder on
//! one host) serves single-host tests and tools that have no store.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::CommError;

/// The subset of the rendezvous store NCCL bootstrap needs.
pub trait IdExchange: Send + Sync {
    /// Publishes `value` under `key` (keys are written once).
    fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError>;
    /// Waits until every key exists and returns their values in order; fails after `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, CommError>;
}

/// An exchange through files in one folder (one host; atomic by rename).
#[derive(Clone, Debug)]
pub struct FileExchange {
    dir: PathBuf,
}

impl FileExchange {
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self, CommError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|source| CommError::Io {
            context: format!("file exchange: creating {}", dir.display()),
            source,
        })?;
        Ok(FileExchange { dir })
    }

    fn path(&self, key: &str) -> PathBuf {
        let safe: String = key
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '.'
                }
            })
            .collect();
        self.dir.join(safe)
    }
}

impl IdExchange for FileExchange {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let p = self.path(key);
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, value)
            .and_then(|_| std::fs::rename(&tmp, &p))
            .map_err(|source| CommError::Io {
                context: format!("file exchange: writing key {key} at {}", p.display()),
                source,
            })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, CommError> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let p = self.path(key);
            loop {
                if let Ok(v) = std::fs::read(&p) {
                    out.push(v);
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(CommError::Rendezvous(format!(
                        "file exchange: key {key} did not appear in {} within {timeout:?}",
                        self.dir.display()
                    )));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        Ok(out)
    }
}

impl IdExchange for crate::rendezvous::StoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        crate::rendezvous::StoreClient::set(self, key, value)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, CommError> {
        crate::rendezvous::StoreClient::wait(self, keys, timeout)
    }
}
