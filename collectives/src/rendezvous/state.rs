//! The rendezvous store's in-memory state: the key-value map, reusable barriers, and bounded
//! waits on both (a `Notify` wakes waiters on every change; every wait has a deadline).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::Instant;
use tonic::Status;

use super::config::StoreConfig;

/// Outcome of a wait: every key present (values in request order) or the keys still missing.
pub(crate) enum WaitOutcome {
    Done(Vec<Vec<u8>>),
    Missing(Vec<String>),
}

/// Outcome of one barrier call.
pub(crate) struct BarrierOutcome {
    pub done: bool,
    pub arrived: u32,
    pub arrived_ranks: Vec<u32>,
}

/// Outcome of compare-and-set: whether it swapped and the value afterwards.
pub(crate) struct CompareSetOutcome {
    pub swapped: bool,
    pub value: Option<Vec<u8>>,
}

struct BarrierState {
    n: u32,
    generation: u64,
    /// arrival id -> rank (when the caller gave one) of the arrivals now waiting.
    arrived: HashMap<String, Option<u32>>,
    /// Every arrival of this round, also those that timed out and withdrew (for the report of
    /// who never came); cleared when the round completes or its last waiter leaves.
    seen: HashMap<String, Option<u32>>,
    /// Arrival ids of the last completed generation, so a retried call of one of them succeeds.
    last_completed: HashSet<String>,
}

#[derive(Default)]
struct Inner {
    kv: HashMap<String, Vec<u8>>,
    barriers: HashMap<String, BarrierState>,
    total_bytes: usize,
}

/// The shared store state.
pub(crate) struct StoreState {
    inner: Mutex<Inner>,
    changed: Notify,
    closed: AtomicBool,
    /// Wait and barrier calls blocked in the server right now.
    blocked_calls: AtomicUsize,
    config: StoreConfig,
}

/// Counts one blocked wait or barrier call in `StoreState::blocked_calls` while it lives.
struct BlockedCall<'a>(&'a AtomicUsize);

impl<'a> BlockedCall<'a> {
    fn enter(count: &'a AtomicUsize) -> BlockedCall<'a> {
        count.fetch_add(1, Ordering::SeqCst);
        BlockedCall(count)
    }
}

impl Drop for BlockedCall<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Most arrivals of one barrier round remembered for timeout reports.
const MAX_SEEN: usize = 1 << 20;

fn shutting_down() -> Status {
    Status::unavailable("rendezvous store is shutting down")
}

impl StoreState {
    pub fn new(config: StoreConfig) -> Arc<StoreState> {
        Arc::new(StoreState {
            inner: Mutex::new(Inner::default()),
            changed: Notify::new(),
            closed: AtomicBool::new(false),
            blocked_calls: AtomicUsize::new(0),
            config,
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// How many wait and barrier calls are blocked in the server now.
    pub fn blocked_calls(&self) -> usize {
        self.blocked_calls.load(Ordering::SeqCst)
    }

    /// Wakes every waiter and makes them (and later waits) return `unavailable`.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means another handler panicked mid-update; the map itself is
        // still consistent for our purposes (every update is a single insert/remove).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_room(
        &self,
        inner: &Inner,
        op: &str,
        key: &str,
        old: Option<usize>,
        new_len: usize,
    ) -> Result<(), Status> {
        let entries = inner.kv.len() + inner.barriers.len() + usize::from(old.is_none());
        if entries > self.config.max_entries {
            return Err(Status::resource_exhausted(format!(
                "{op} {key:?}: the store holds its maximum of {} entries",
                self.config.max_entries
            )));
        }
        let freed = old.map_or(0, |v| v + key.len());
        let total = inner.total_bytes - freed + key.len() + new_len;
        if total > self.config.max_total_bytes {
            return Err(Status::resource_exhausted(format!(
                "{op} {key:?}: storing {new_len} bytes would exceed the store's limit of {} bytes",
                self.config.max_total_bytes
            )));
        }
        Ok(())
    }

    fn insert(inner: &mut Inner, key: &str, value: Vec<u8>) {
        let new_len = key.len() + value.len();
        if let Some(old) = inner.kv.insert(key.to_string(), value) {
            inner.total_bytes -= key.len() + old.len();
        }
        inner.total_bytes += new_len;
    }

    pub fn set(&self, key: &str, value: Vec<u8>) -> Result<(), Status> {
        {
            let mut inner = self.lock();
            let old = inner.kv.get(key).map(Vec::len);
            self.check_room(&inner, "set", key, old, value.len())?;
            Self::insert(&mut inner, key, value);
        }
        self.changed.notify_waiters();
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.lock().kv.get(key).cloned()
    }

    pub fn delete(&self, key: &str) -> bool {
        let mut inner = self.lock();
        match inner.kv.remove(key) {
            Some(old) => {
                inner.total_bytes -= key.len() + old.len();
                true
            }
            None => false,
        }
    }

    pub fn add(&self, key: &str, delta: i64) -> Result<i64, Status> {
        let new = {
            let mut inner = self.lock();
            let current = match inner.kv.get(key) {
                None => 0i64,
                Some(bytes) => std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|s| s.trim().parse::<i64>().ok())
                    .ok_or_else(|| {
                        Status::invalid_argument(format!(
                            "add {key:?}: the current value ({} bytes) is not a decimal integer",
                            bytes.len()
                        ))
                    })?,
            };
            let new = current.checked_add(delta).ok_or_else(|| {
                Status::out_of_range(format!("add {key:?}: {current} + {delta} overflows i64"))
            })?;
            let text = new.to_string().into_bytes();
            let old = inner.kv.get(key).map(Vec::len);
            self.check_room(&inner, "add", key, old, text.len())?;
            Self::insert(&mut inner, key, text);
            new
        };
        self.changed.notify_waiters();
        Ok(new)
    }

    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: Vec<u8>,
    ) -> Result<CompareSetOutcome, Status> {
        let outcome = {
            let mut inner = self.lock();
            let current = inner.kv.get(key);
            if current.map(Vec::as_slice) != expected {
                return Ok(CompareSetOutcome {
                    swapped: false,
                    value: current.cloned(),
                });
            }
            let old = current.map(Vec::len);
            self.check_room(&inner, "compare_set", key, old, desired.len())?;
            Self::insert(&mut inner, key, desired.clone());
            CompareSetOutcome {
                swapped: true,
                value: Some(desired),
            }
        };
        self.changed.notify_waiters();
        Ok(outcome)
    }

    /// Runs `check` on the store now and after every change until it answers (`Some`); a
    /// blocked call while it waits, `shutting_down` once the store closes. `check` sees the
    /// deadline itself (a change or the deadline wakes it, whichever comes first).
    async fn wait_for<T>(
        &self,
        deadline: Instant,
        mut check: impl FnMut(&Inner) -> Result<Option<T>, Status>,
    ) -> Result<T, Status> {
        let _blocked = BlockedCall::enter(&self.blocked_calls);
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.closed.load(Ordering::SeqCst) {
                return Err(shutting_down());
            }
            let answer = check(&self.lock())?;
            if let Some(out) = answer {
                return Ok(out);
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// Waits until every key exists or `deadline` passes.
    pub async fn wait(&self, keys: &[String], deadline: Instant) -> Result<WaitOutcome, Status> {
        self.wait_for(deadline, |inner| {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !inner.kv.contains_key(*k))
                .cloned()
                .collect();
            if missing.is_empty() {
                let values = keys
                    .iter()
                    .map(|k| inner.kv.get(k).cloned().unwrap_or_default())
                    .collect();
                return Ok(Some(WaitOutcome::Done(values)));
            }
            Ok((Instant::now() >= deadline).then_some(WaitOutcome::Missing(missing)))
        })
        .await
    }

    /// One arrival at barrier `name` of `n` members. The arrival counts only while its call is
    /// waiting: on timeout (or when the caller goes away) it is withdrawn, so a retry with the
    /// same `arrival_id` never counts twice and a dead rank never completes a barrier.
    pub async fn barrier(
        self: &Arc<Self>,
        name: &str,
        n: u32,
        arrival_id: &str,
        rank: Option<u32>,
        deadline: Instant,
    ) -> Result<BarrierOutcome, Status> {
        let generation = {
            let mut inner = self.lock();
            if !inner.barriers.contains_key(name) {
                let entries = inner.kv.len() + inner.barriers.len() + 1;
                if entries > self.config.max_entries {
                    return Err(Status::resource_exhausted(format!(
                        "barrier {name:?}: the store holds its maximum of {} entries",
                        self.config.max_entries
                    )));
                }
                inner.barriers.insert(
                    name.to_string(),
                    BarrierState {
                        n,
                        generation: 0,
                        arrived: HashMap::new(),
                        seen: HashMap::new(),
                        last_completed: HashSet::new(),
                    },
                );
            }
            let Some(b) = inner.barriers.get_mut(name) else {
                return Err(Status::internal(format!("barrier {name:?} vanished")));
            };
            if b.last_completed.contains(arrival_id) && !b.arrived.contains_key(arrival_id) {
                return Ok(BarrierOutcome {
                    done: true,
                    arrived: n,
                    arrived_ranks: Vec::new(),
                });
            }
            if b.arrived.is_empty() {
                b.n = n;
            } else if b.n != n {
                return Err(Status::failed_precondition(format!(
                    "barrier {name:?}: this arrival expects {n} members but earlier arrivals expect {}",
                    b.n
                )));
            }
            if let Some(r) = rank {
                if r >= n {
                    return Err(Status::invalid_argument(format!(
                        "barrier {name:?}: rank {r} is outside 0..{n}"
                    )));
                }
                let dup = b
                    .arrived
                    .iter()
                    .any(|(id, other)| *other == Some(r) && id != arrival_id);
                if dup {
                    return Err(Status::failed_precondition(format!(
                        "barrier {name:?}: rank {r} arrived twice"
                    )));
                }
            }
            b.arrived.insert(arrival_id.to_string(), rank);
            if b.seen.len() < MAX_SEEN {
                b.seen.insert(arrival_id.to_string(), rank);
            }
            if b.arrived.len() >= n as usize {
                b.last_completed = b.arrived.drain().map(|(id, _)| id).collect();
                b.seen.clear();
                b.generation += 1;
                drop(inner);
                self.changed.notify_waiters();
                return Ok(BarrierOutcome {
                    done: true,
                    arrived: n,
                    arrived_ranks: Vec::new(),
                });
            }
            b.generation
        };
        let mut guard = ArrivalGuard {
            state: Arc::clone(self),
            name: name.to_string(),
            arrival_id: arrival_id.to_string(),
            generation,
            active: true,
        };
        self.wait_for(deadline, |inner| {
            let Some(b) = inner.barriers.get(name) else {
                return Err(Status::internal(format!("barrier {name:?} vanished")));
            };
            if b.generation != generation {
                guard.active = false;
                return Ok(Some(BarrierOutcome {
                    done: true,
                    arrived: n,
                    arrived_ranks: Vec::new(),
                }));
            }
            if Instant::now() < deadline {
                return Ok(None);
            }
            let mut arrived_ranks: Vec<u32> = b.seen.values().flatten().copied().collect();
            arrived_ranks.sort_unstable();
            arrived_ranks.dedup();
            // `guard` withdraws this arrival on the way out.
            Ok(Some(BarrierOutcome {
                done: false,
                arrived: u32::try_from(b.seen.len()).unwrap_or(u32::MAX),
                arrived_ranks,
            }))
        })
        .await
    }
}

/// Withdraws a barrier arrival when its call ends without the barrier completing.
struct ArrivalGuard {
    state: Arc<StoreState>,
    name: String,
    arrival_id: String,
    generation: u64,
    active: bool,
}

impl Drop for ArrivalGuard {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        let mut inner = self.state.lock();
        if let Some(b) = inner.barriers.get_mut(&self.name) {
            if b.generation == self.generation {
                b.arrived.remove(&self.arrival_id);
                if b.arrived.is_empty() {
                    b.seen.clear();
                }
            }
        }
    }
}
