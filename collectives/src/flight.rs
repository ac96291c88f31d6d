//! The flight recorder: every rank keeps its last N collective (and boxing) calls in a ring of
//! preallocated entries, so a hang or failure can be traced to the call each rank was in. The
//! `Communicator` boundary records every call; on a failure the ring is written as JSON to
//! `<dir>/flight-rank<R>.json` when a dump directory is set.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::CommError;

/// Entries a recorder keeps unless told otherwise.
pub const DEFAULT_FLIGHT_ENTRIES: usize = 256;

/// One recorded call.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FlightEntry {
    /// Per-communicator call number (per-recorder for boxing steps), from 0.
    pub seq: u64,
    pub op: String,
    /// World ranks of the communicator, in member order.
    pub group: Vec<usize>,
    pub dtype: String,
    /// Bytes this rank sends (or holds, for in-place calls).
    pub bytes: u64,
    /// Root of a rooted call or peer of a point-to-point one, as a member index.
    pub peer: Option<usize>,
    pub state: FlightState,
    pub started_unix_ms: u64,
    pub finished_unix_ms: Option<u64>,
    /// A tensor-layer step (`begin_boxing`), not a call of a communicator.
    #[serde(default)]
    pub boxing: bool,
}

/// Where a recorded call is.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum FlightState {
    /// Entered; its arguments are being checked.
    Queued,
    /// Arguments accepted; communicating.
    Started,
    Finished,
    /// Returned this error.
    Failed(String),
}

/// The JSON document `FlightRecorder::to_json` writes and the dump files hold.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FlightDump {
    pub rank: usize,
    /// Oldest first.
    pub entries: Vec<FlightEntry>,
}

/// What a new entry describes (see [`FlightEntry`] for the fields).
#[derive(Clone, Debug)]
pub struct FlightCall<'a> {
    pub seq: u64,
    pub op: Cow<'static, str>,
    pub group: &'a Arc<[usize]>,
    pub dtype: &'static str,
    pub bytes: u64,
    pub peer: Option<usize>,
}

/// Names the entry a call created, for its later state changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlightTicket(u64);

/// An entry as stored: no allocation beyond a dynamic op name or an error text.
struct Slot {
    /// Index of the call in the recorder's history (`u64::MAX` while unused).
    id: u64,
    seq: u64,
    op: Cow<'static, str>,
    group: Arc<[usize]>,
    dtype: &'static str,
    bytes: u64,
    peer: Option<usize>,
    state: FlightState,
    started_unix_ms: u64,
    finished_unix_ms: Option<u64>,
    boxing: bool,
}

impl Slot {
    fn to_entry(&self) -> FlightEntry {
        FlightEntry {
            seq: self.seq,
            op: self.op.to_string(),
            group: self.group.to_vec(),
            dtype: self.dtype.to_string(),
            bytes: self.bytes,
            peer: self.peer,
            state: self.state.clone(),
            started_unix_ms: self.started_unix_ms,
            finished_unix_ms: self.finished_unix_ms,
            boxing: self.boxing,
        }
    }
}

struct Ring {
    slots: Vec<Slot>,
    capacity: usize,
    /// Calls recorded so far; the next one goes to `next % capacity`.
    next: u64,
    rank: usize,
    dump_dir: Option<PathBuf>,
}

impl Ring {
    fn slot_mut(&mut self, t: FlightTicket) -> Option<&mut Slot> {
        let cap = self.capacity as u64;
        let s = self.slots.get_mut(usize::try_from(t.0 % cap).ok()?)?;
        (s.id == t.0).then_some(s)
    }
}

/// A ring of the last calls of this process (see the module docs).
pub struct FlightRecorder {
    ring: Mutex<Ring>,
    boxing_seq: AtomicU64,
}

/// The process-wide recorder the communicators write to.
pub fn flight_recorder() -> &'static FlightRecorder {
    static RECORDER: OnceLock<FlightRecorder> = OnceLock::new();
    RECORDER.get_or_init(|| FlightRecorder::new(DEFAULT_FLIGHT_ENTRIES))
}

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn empty_group() -> Arc<[usize]> {
    static EMPTY: OnceLock<Arc<[usize]>> = OnceLock::new();
    EMPTY.get_or_init(|| Arc::from(Vec::new())).clone()
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` calls (at least one).
    pub fn new(capacity: usize) -> FlightRecorder {
        FlightRecorder {
            ring: Mutex::new(Ring {
                slots: Vec::new(),
                capacity: capacity.max(1),
                next: 0,
                rank: 0,
                dump_dir: None,
            }),
            boxing_seq: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        // Every critical section here is panic-free, so a poisoned lock holds a valid ring.
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rank written into dumps and file names.
    pub fn set_rank(&self, rank: usize) {
        self.lock().rank = rank;
    }

    pub fn rank(&self) -> usize {
        self.lock().rank
    }

    /// Where failures dump the ring (`None`: no dump).
    pub fn set_dump_dir(&self, dir: Option<PathBuf>) {
        self.lock().dump_dir = dir;
    }

    /// The directory failures dump to, if set.
    pub fn dump_dir(&self) -> Option<PathBuf> {
        self.lock().dump_dir.clone()
    }

    /// Keeps the last `capacity` calls from now on (at least one); drops what was recorded.
    pub fn set_capacity(&self, capacity: usize) {
        let mut r = self.lock();
        r.capacity = capacity.max(1);
        r.slots = Vec::new();
        r.next = 0;
    }

    /// Records a call in state `Queued`.
    pub fn begin(&self, call: FlightCall<'_>) -> FlightTicket {
        self.insert(call, FlightState::Queued, false)
    }

    fn insert(&self, call: FlightCall<'_>, state: FlightState, boxing: bool) -> FlightTicket {
        let started_unix_ms = unix_ms();
        let mut r = self.lock();
        let id = r.next;
        r.next = r.next.wrapping_add(1);
        let slot = Slot {
            id,
            seq: call.seq,
            op: call.op,
            group: call.group.clone(),
            dtype: call.dtype,
            bytes: call.bytes,
            peer: call.peer,
            state,
            started_unix_ms,
            finished_unix_ms: None,
            boxing,
        };
        let cap = r.capacity as u64;
        match usize::try_from(id % cap) {
            Ok(i) if i < r.slots.len() => r.slots[i] = slot,
            _ => {
                if r.slots.capacity() == 0 {
                    let cap = r.capacity;
                    r.slots.reserve_exact(cap);
                }
                r.slots.push(slot);
            }
        }
        FlightTicket(id)
    }

    /// Marks a call `Started` (its arguments were accepted).
    pub fn start(&self, t: FlightTicket) {
        if let Some(s) = self.lock().slot_mut(t) {
            s.state = FlightState::Started;
        }
    }

    /// Marks a call `Finished` or `Failed`; a failure dumps the ring when a dump directory is
    /// set. A dump that cannot be written is logged (the call's own error is what matters).
    pub fn finish(&self, t: FlightTicket, outcome: Result<(), &CommError>) {
        let now = unix_ms();
        let dump = {
            let mut r = self.lock();
            if let Some(s) = r.slot_mut(t) {
                s.finished_unix_ms = Some(now);
                s.state = match outcome {
                    Ok(()) => FlightState::Finished,
                    Err(e) => FlightState::Failed(e.to_string()),
                };
            }
            match (outcome, &r.dump_dir) {
                (Err(_), Some(dir)) => Some((dir.clone(), r.rank)),
                _ => None,
            }
        };
        if let Some((dir, rank)) = dump {
            if let Err(e) = self.dump_to(&dir, rank) {
                tracing::warn!("flight recorder: {e}");
            }
        }
    }

    /// Records a boxing step (or any tensor-layer step) as `Started`; end it with `finish`.
    /// Sequence numbers of these count per recorder.
    pub fn begin_boxing(
        &self,
        op: impl Into<Cow<'static, str>>,
        group: &[usize],
        dtype: &'static str,
        bytes: u64,
    ) -> FlightTicket {
        let seq = self.boxing_seq.fetch_add(1, Ordering::Relaxed);
        let group: Arc<[usize]> = if group.is_empty() {
            empty_group()
        } else {
            Arc::from(group)
        };
        let call = FlightCall {
            seq,
            op: op.into(),
            group: &group,
            dtype,
            bytes,
            peer: None,
        };
        self.insert(call, FlightState::Started, true)
    }

    /// Records a finished boxing step in one go.
    pub fn record_boxing(
        &self,
        op: impl Into<Cow<'static, str>>,
        group: &[usize],
        dtype: &'static str,
        bytes: u64,
        outcome: Result<(), &CommError>,
    ) {
        let t = self.begin_boxing(op, group, dtype, bytes);
        self.finish(t, outcome);
    }

    /// The recorded calls, oldest first.
    pub fn snapshot(&self) -> Vec<FlightEntry> {
        let r = self.lock();
        let n = r.slots.len();
        let cap = r.capacity as u64;
        let first = usize::try_from(r.next % cap).unwrap_or(0);
        let start = if n < r.capacity { 0 } else { first };
        (0..n)
            .map(|k| r.slots[(start + k) % n].to_entry())
            .collect()
    }

    /// The most recent call.
    pub fn last(&self) -> Option<FlightEntry> {
        let r = self.lock();
        let cap = r.capacity as u64;
        let id = r.next.checked_sub(1)?;
        r.slots
            .get(usize::try_from(id % cap).ok()?)
            .map(Slot::to_entry)
    }

    /// `{"rank":R,"entries":[...]}`, entries oldest first.
    pub fn to_json(&self) -> String {
        let dump = FlightDump {
            rank: self.rank(),
            entries: self.snapshot(),
        };
        serde_json::to_string(&dump).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Writes the ring to `<dir>/flight-rank<R>.json` (through a temporary file, so readers
    /// never see half a dump); returns the path.
    pub fn dump(&self, dir: &Path) -> Result<PathBuf, CommError> {
        self.dump_to(dir, self.rank())
    }

    fn dump_to(&self, dir: &Path, rank: usize) -> Result<PathBuf, CommError> {
        let path = dir.join(format!("flight-rank{rank}.json"));
        let tmp = dir.join(format!(".flight-rank{rank}.json.{}", std::process::id()));
        let io = |context: String| move |source| CommError::Io { context, source };
        std::fs::create_dir_all(dir)
            .map_err(io(format!("flight recorder: create {}", dir.display())))?;
        std::fs::write(&tmp, self.to_json())
            .map_err(io(format!("flight recorder: write {}", tmp.display())))?;
        std::fs::rename(&tmp, &path)
            .map_err(io(format!("flight recorder: rename to {}", path.display())))?;
        Ok(path)
    }
}

/// A communicator's part of the record: its group and its call counter.
pub(crate) struct CommLog {
    group: Arc<[usize]>,
    seq: AtomicU64,
}

impl CommLog {
    /// World ranks of the communicator, in member order.
    pub(crate) fn group(&self) -> &[usize] {
        &self.group
    }

    pub(crate) fn new(world_ranks: &[usize]) -> CommLog {
        CommLog {
            group: Arc::from(world_ranks),
            seq: AtomicU64::new(0),
        }
    }

    /// Records the next call of this communicator as `Queued`.
    pub(crate) fn begin(
        &self,
        op: &'static str,
        dtype: &'static str,
        bytes: usize,
        peer: Option<usize>,
    ) -> FlightTicket {
        flight_recorder().begin(FlightCall {
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            op: Cow::Borrowed(op),
            group: &self.group,
            dtype,
            bytes: bytes as u64,
            peer,
        })
    }
}
