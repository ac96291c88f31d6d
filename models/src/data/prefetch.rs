//! `Prefetcher`: a background thread that makes the next items of a known sequence (the
//! batches of the coming steps) while the caller works on the current one. Items are asked for
//! by key; a key other than the next one restarts the thread there.

use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::error::DataError;

/// How long a request waits for the thread before it is an error.
pub const PREFETCH_TIMEOUT: Duration = Duration::from_secs(120);

type Make<T> = dyn Fn(u64) -> Result<T, DataError> + Send + Sync;
/// A running thread: the key it makes next, where its items arrive, the thread.
type Running<T> = (u64, Receiver<(u64, Result<T, DataError>)>, JoinHandle<()>);

/// Makes `make(k)` for keys `k, k + 1, ...` ahead of use, at most `depth` items ahead.
pub struct Prefetcher<T: Send + 'static> {
    make: Arc<Make<T>>,
    depth: usize,
    running: Option<Running<T>>,
}

impl<T: Send + 'static> Prefetcher<T> {
    pub fn new(
        depth: usize,
        make: impl Fn(u64) -> Result<T, DataError> + Send + Sync + 'static,
    ) -> Self {
        Prefetcher {
            make: Arc::new(make),
            depth: depth.max(1),
            running: None,
        }
    }

    fn start(&mut self, from: u64) {
        self.stop();
        let (tx, rx) = sync_channel(self.depth);
        let make = Arc::clone(&self.make);
        let thread = std::thread::spawn(move || {
            let mut k = from;
            loop {
                let item = make(k);
                let failed = item.is_err();
                if tx.send((k, item)).is_err() || failed {
                    return;
                }
                k += 1;
            }
        });
        self.running = Some((from, rx, thread));
    }

    fn stop(&mut self) {
        if let Some((_, rx, thread)) = self.running.take() {
            drop(rx);
            // The thread ends at its next send (at most one item away).
            let _ = thread.join();
        }
    }

    /// The item of key `key`; the thread then works on the keys after it.
    pub fn get(&mut self, key: u64) -> Result<T, DataError> {
        if self.running.as_ref().map(|r| r.0) != Some(key) {
            self.start(key);
        }
        let Some((next, rx, _)) = self.running.as_mut() else {
            return Err(DataError::Sampling {
                op: "Prefetcher::get",
                detail: "the prefetch thread did not start".into(),
            });
        };
        let got = match rx.recv_timeout(PREFETCH_TIMEOUT) {
            Ok((k, item)) if k == key => item,
            Ok((k, _)) => Err(DataError::Sampling {
                op: "Prefetcher::get",
                detail: format!("asked for item {key} but the thread made {k}"),
            }),
            Err(RecvTimeoutError::Timeout) => Err(DataError::Sampling {
                op: "Prefetcher::get",
                detail: format!("item {key} was not ready within {PREFETCH_TIMEOUT:?}"),
            }),
            Err(RecvTimeoutError::Disconnected) => Err(DataError::Sampling {
                op: "Prefetcher::get",
                detail: format!("the prefetch thread ended before item {key}"),
            }),
        };
        *next = key + 1;
        if got.is_err() {
            self.stop();
        }
        got
    }
}

impl<T: Send + 'static> Drop for Prefetcher<T> {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_come_in_order_and_jumps_restart() {
        let mut p = Prefetcher::new(2, |k| Ok(k * 10));
        assert_eq!(p.get(3).unwrap(), 30);
        assert_eq!(p.get(4).unwrap(), 40);
        assert_eq!(p.get(9).unwrap(), 90);
        assert_eq!(p.get(2).unwrap(), 20);
        let mut bad = Prefetcher::new(1, |k| {
            if k == 1 {
                Err(DataError::Sampling {
                    op: "t",
                    detail: "no".into(),
                })
            } else {
                Ok(k)
            }
        });
        assert_eq!(bad.get(0).unwrap(), 0);
        assert!(bad.get(1).is_err());
        assert_eq!(bad.get(2).unwrap(), 2);
    }
}
