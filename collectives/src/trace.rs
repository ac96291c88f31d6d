//! The timeline trace: when enabled (`OXIFLOW_TRACE_DIR`, set by `oflaunch --trace DIR`), each
//! op, boxing step and collective of this process is recorded as a Chrome-trace complete
//! event (`ph: "X"`, `pid` = rank, `tid` = lane, times in wall-clock microseconds since the Unix
//! epoch, so ranks of one host share a clock) and written to `<dir>/rank-<R>.json` by
//! [`write_rank_trace`]; [`merge_traces`] joins the rank files into one `trace.json` that
//! chrome://tracing and Perfetto open. When disabled, each recording point costs one relaxed
//! atomic load. At most `MAX_TRACE_EVENTS` events are kept; later ones are counted as dropped.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::CommError;

/// Events one process keeps at most (about 100 MiB of JSON).
pub const MAX_TRACE_EVENTS: usize = 1 << 20;
/// Rank trace files in a trace directory, and the merged file.
pub const MERGED_TRACE_FILE: &str = "trace.json";

/// The timeline row (`tid`) an event goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    Ops = 1,
    Boxing = 2,
    Collectives = 3,
    /// Kernels on the CUDA compute stream, timed by device events.
    CudaCompute = 4,
    /// NCCL work on the communicator's stream, timed by device events.
    CudaComm = 5,
}

impl Lane {
    const ALL: [Lane; 5] = [
        Lane::Ops,
        Lane::Boxing,
        Lane::Collectives,
        Lane::CudaCompute,
        Lane::CudaComm,
    ];

    fn name(self) -> &'static str {
        match self {
            Lane::Ops => "ops",
            Lane::Boxing => "boxing",
            Lane::Collectives => "collectives",
            Lane::CudaCompute => "cuda compute stream",
            Lane::CudaComm => "cuda nccl stream",
        }
    }
}

/// Something that holds spans timed elsewhere (device events) and records them, with
/// [`record_span`], when asked to flush: before a rank's trace is written, and whenever its
/// owner decides (e.g. when its pending list is long).
pub type TraceFlush = fn();

static FLUSHES: Mutex<Vec<TraceFlush>> = Mutex::new(Vec::new());

/// Registers `flush`, called by [`write_rank_trace`] before the file is written (once per
/// distinct function).
pub fn register_trace_flush(flush: TraceFlush) {
    let mut f = FLUSHES.lock().unwrap_or_else(|e| e.into_inner());
    if !f.iter().any(|g| std::ptr::fn_addr_eq(*g, flush)) {
        f.push(flush);
    }
}

/// One Chrome-trace event (complete `X` events and `M` metadata).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TraceEvent {
    pub name: String,
    #[serde(default)]
    pub cat: String,
    pub ph: String,
    #[serde(default)]
    pub ts: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<u64>,
    pub pid: u64,
    pub tid: u64,
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub args: Map<String, Value>,
}

/// A trace file: `{"traceEvents": [...]}`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TraceFile {
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<TraceEvent>,
}

struct Recorded {
    name: Cow<'static, str>,
    lane: Lane,
    start_us: u64,
    dur_us: u64,
    args: Vec<(&'static str, Value)>,
}

#[derive(Default)]
struct TraceState {
    dir: Option<PathBuf>,
    rank: usize,
    events: Vec<Recorded>,
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);

fn state() -> std::sync::MutexGuard<'static, TraceState> {
    static STATE: OnceLock<Mutex<TraceState>> = OnceLock::new();
    // Every critical section here is panic-free, so a poisoned lock holds valid state.
    STATE
        .get_or_init(|| Mutex::new(TraceState::default()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Microseconds since the Unix epoch (the trace's clock).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Whether this process records a trace.
#[inline]
pub fn trace_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Starts recording as `rank`; [`write_rank_trace`] writes to `dir`. Runs the hooks of
/// [`on_trace_enabled`] when the trace was off.
pub fn enable_trace(rank: usize, dir: PathBuf) {
    {
        let mut s = state();
        s.dir = Some(dir);
        s.rank = rank;
    }
    if !ENABLED.swap(true, Ordering::Relaxed) {
        let hooks = ENABLE_HOOKS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        hooks.iter().for_each(|h| h());
    }
}

/// What runs when the trace is switched on (e.g. a layer above starting its own spans).
pub type TraceEnableHook = fn();

static ENABLE_HOOKS: Mutex<Vec<TraceEnableHook>> = Mutex::new(Vec::new());

/// Registers `hook` (once per distinct function), run when [`enable_trace`] switches the
/// trace on, and at once when it is on already.
pub fn on_trace_enabled(hook: TraceEnableHook) {
    {
        let mut h = ENABLE_HOOKS.lock().unwrap_or_else(|e| e.into_inner());
        if h.iter().any(|g| std::ptr::fn_addr_eq(*g, hook)) {
            return;
        }
        h.push(hook);
    }
    if trace_enabled() {
        hook();
    }
}

/// The start of an event: the time when tracing is on, else None (nothing else is done).
#[inline]
pub fn trace_start() -> Option<u64> {
    trace_enabled().then(now_us)
}

/// Records an event begun at `start` (from [`trace_start`]); the name and arguments are only
/// built when tracing is on.
#[inline]
pub fn trace_end(
    start: Option<u64>,
    lane: Lane,
    name: impl FnOnce() -> Cow<'static, str>,
    args: impl FnOnce() -> Vec<(&'static str, Value)>,
) {
    if let Some(start_us) = start {
        record(start_us, lane, name(), args());
    }
}

#[cold]
fn record(start_us: u64, lane: Lane, name: Cow<'static, str>, args: Vec<(&'static str, Value)>) {
    let dur_us = now_us().saturating_sub(start_us);
    record_span(start_us, dur_us, lane, name, args);
}

/// Records an event whose start and duration were measured elsewhere (device events converted
/// to wall-clock microseconds). Nothing is kept when tracing is off.
pub fn record_span(
    start_us: u64,
    dur_us: u64,
    lane: Lane,
    name: Cow<'static, str>,
    args: Vec<(&'static str, Value)>,
) {
    if !trace_enabled() {
        return;
    }
    let mut s = state();
    if s.events.len() >= MAX_TRACE_EVENTS {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    s.events.push(Recorded {
        name,
        lane,
        start_us,
        dur_us,
        args,
    });
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> CommError {
    move |source| CommError::Io { context, source }
}

/// This rank's events as a trace file, with the process and lane names.
fn rank_trace(s: &TraceState) -> TraceFile {
    let pid = s.rank as u64;
    let meta = |name: &str, tid: u64, value: String| TraceEvent {
        name: name.into(),
        cat: String::new(),
        ph: "M".into(),
        ts: 0,
        dur: None,
        pid,
        tid,
        args: Map::from_iter([("name".to_string(), Value::String(value))]),
    };
    let mut events = vec![meta("process_name", 0, format!("rank {}", s.rank))];
    for lane in Lane::ALL {
        events.push(meta("thread_name", lane as u64, lane.name().into()));
    }
    let dropped = DROPPED.load(Ordering::Relaxed);
    if dropped > 0 {
        events.push(meta("dropped_events", 0, dropped.to_string()));
    }
    events.extend(s.events.iter().map(|e| {
        TraceEvent {
            name: e.name.to_string(),
            cat: e.lane.name().into(),
            ph: "X".into(),
            ts: e.start_us,
            dur: Some(e.dur_us),
            pid,
            tid: e.lane as u64,
            args: e
                .args
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        }
    }));
    TraceFile {
        trace_events: events,
    }
}

/// Writes this rank's trace to `<dir>/rank-<R>.json` (through a temporary file) when tracing
/// is on; returns the path, None when off.
pub fn write_rank_trace() -> Result<Option<PathBuf>, CommError> {
    if !trace_enabled() {
        return Ok(None);
    }
    let flushes = FLUSHES.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for flush in flushes {
        flush();
    }
    let (dir, rank, file) = {
        let s = state();
        let Some(dir) = s.dir.clone() else {
            return Ok(None);
        };
        (dir, s.rank, rank_trace(&s))
    };
    let path = dir.join(format!("rank-{rank}.json"));
    let tmp = dir.join(format!(".rank-{rank}.json.{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(io(format!("trace: create {}", dir.display())))?;
    let bytes = serde_json::to_vec(&file)
        .map_err(|e| CommError::Rendezvous(format!("trace: encoding rank {rank}'s trace: {e}")))?;
    std::fs::write(&tmp, bytes).map_err(io(format!("trace: write {}", tmp.display())))?;
    std::fs::rename(&tmp, &path).map_err(io(format!("trace: rename to {}", path.display())))?;
    Ok(Some(path))
}

/// Joins the `rank-<R>.json` files of `dir` into `<dir>/trace.json` (one timeline, events
/// in time order); returns its path and the ranks merged. A rank file that cannot be read is
/// an error naming it.
pub fn merge_traces(dir: &Path) -> Result<(PathBuf, Vec<usize>), CommError> {
    let entries = std::fs::read_dir(dir).map_err(io(format!("trace: read {}", dir.display())))?;
    let mut ranks: Vec<(usize, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name();
            let rank = name
                .to_str()?
                .strip_prefix("rank-")?
                .strip_suffix(".json")?
                .parse()
                .ok()?;
            Some((rank, e.path()))
        })
        .collect();
    ranks.sort();
    let mut merged = TraceFile::default();
    for (rank, path) in &ranks {
        let bytes = std::fs::read(path).map_err(io(format!("trace: read {}", path.display())))?;
        let file: TraceFile = serde_json::from_slice(&bytes).map_err(|e| {
            CommError::Rendezvous(format!(
                "trace: rank {rank}'s file {} is not a trace: {e}",
                path.display()
            ))
        })?;
        merged.trace_events.extend(file.trace_events);
    }
    merged.trace_events.sort_by_key(|e| (e.ph != "M", e.ts));
    let out = dir.join(MERGED_TRACE_FILE);
    let bytes = serde_json::to_vec(&merged)
        .map_err(|e| CommError::Rendezvous(format!("trace: encoding the merged trace: {e}")))?;
    std::fs::write(&out, bytes).map_err(io(format!("trace: write {}", out.display())))?;
    Ok((out, ranks.into_iter().map(|(r, _)| r).collect()))
}
