//! Watching the ranks: twice a second oflaunch reads each rank's heartbeat from the store (its
//! flight-recorder progress per communicator group) and the state of this node's workers'
//! main threads, prints which rank is behind when others have waited `BEHIND_AFTER` for it
//! (and again every 10 s while they wait),
//! and declares a rank frozen when others wait for it and it shows no progress for the stall
//! timeout (see `stall`); the supervisor then ends the job. The latest heartbeats and the
//! flight dumps the workers wrote go into the failure summary.

use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use oxiflow_collectives::heartbeat::{Heartbeat, HEARTBEAT_PREFIX};
use oxiflow_collectives::rendezvous::{StoreClient, NOTICE_EVERY};
use oxiflow_collectives::{FlightDump, FlightState};

use crate::procfs::main_thread_frozen;
use crate::stall::{find_behind, find_stall, without_frozen_waiters, Behind, Progress, Stall};

/// How long ranks wait in a call before the rank they wait for is named.
pub const BEHIND_AFTER: Duration = Duration::from_secs(3);
/// How often the heartbeats and the local workers' states are read.
const WATCH_PERIOD: Duration = Duration::from_millis(500);
/// A sleep between two reads lasting longer than this means oflaunch itself was paused.
const PAUSED_AFTER: Duration = Duration::from_secs(3);
/// Calls of a rank's flight dump shown in the summary.
const DUMP_CALLS_SHOWN: usize = 3;

/// What the watcher needs to know about this node and the job.
pub struct WatchConfig {
    pub world: usize,
    /// This node's workers as (rank, pid).
    pub local: Vec<(usize, i32)>,
    /// How long a rank others wait for may show no progress (None: never declared frozen).
    pub stall_timeout: Option<Duration>,
}

#[derive(Default)]
struct Seen {
    beats: Vec<Option<Heartbeat>>,
    /// Every rank named as behind so far (as last seen), with the wait it was last printed at.
    named: Vec<(Behind, Duration)>,
    /// The first rank declared frozen.
    stall: Option<Stall>,
}

/// The running watcher; it stops when dropped.
pub struct HangWatch {
    seen: Arc<Mutex<Seen>>,
    _stop: mpsc::Sender<()>,
}

impl HangWatch {
    /// Starts reading the heartbeats of ranks `0..world` from `store` (the generation's) and
    /// the state of this node's workers, every `WATCH_PERIOD`.
    pub fn start(store: StoreClient, cfg: WatchConfig) -> std::io::Result<HangWatch> {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop, stopped) = mpsc::channel::<()>();
        let seen2 = seen.clone();
        std::thread::Builder::new()
            .name("oflaunch-hangwatch".into())
            .spawn(move || {
                let mut progress = Progress::default();
                let mut beats: Vec<Option<Heartbeat>> = vec![None; cfg.world];
                let mut slept_at = Instant::now();
                loop {
                    // oflaunch itself was paused while it slept (SIGSTOP, a frozen node): the
                    // heartbeats it missed say nothing about the ranks, so the pause counts as a
                    // store outage, and no rank is judged until it has watched for the stall
                    // timeout again.
                    let woke = Instant::now();
                    if woke.duration_since(slept_at) > PAUSED_AFTER {
                        progress.observe_beats(woke, None);
                    }
                    let read = read_beats(&store, cfg.world);
                    let now = Instant::now();
                    progress.observe_beats(now, read.as_deref());
                    if let Some(b) = read {
                        beats = b;
                    }
                    for &(rank, pid) in &cfg.local {
                        progress.observe_local(now, rank, main_thread_frozen(pid));
                    }
                    let behind = without_frozen_waiters(find_behind(&beats, BEHIND_AFTER), |r| {
                        progress.main_thread_stopped(r)
                    });
                    let stall = cfg
                        .stall_timeout
                        .and_then(|limit| find_stall(&beats, &progress, now, limit, BEHIND_AFTER));
                    if let Ok(mut s) = seen2.lock() {
                        for b in behind {
                            let same_call = |n: &Behind| {
                                n.rank == b.rank && n.group == b.group && n.seq == b.seq
                            };
                            // Named once, then again every 10 s while the wait lasts.
                            match s.named.iter_mut().find(|(n, _)| same_call(n)) {
                                Some((n, said)) => {
                                    if b.waited >= *said + NOTICE_EVERY {
                                        eprintln!("oflaunch: {}", b.line());
                                        *said = b.waited;
                                    }
                                    *n = b;
                                }
                                None => {
                                    eprintln!("oflaunch: {}", b.line());
                                    let said = b.waited;
                                    s.named.push((b, said));
                                }
                            }
                        }
                        if let (None, Some(stall)) = (&s.stall, stall) {
                            eprintln!("oflaunch: {}; ending the job", stall.line());
                            s.stall = Some(stall);
                        }
                        s.beats = beats.clone();
                    }
                    slept_at = Instant::now();
                    match stopped.recv_timeout(WATCH_PERIOD) {
                        Err(RecvTimeoutError::Timeout) => {}
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
            })?;
        Ok(HangWatch { seen, _stop: stop })
    }

    /// The rank declared frozen, if any.
    pub fn stall(&self) -> Option<Stall> {
        self.seen.lock().ok().and_then(|s| s.stall.clone())
    }

    /// The ranks named as behind and every rank's last reported progress, for the summary;
    /// ranks in `ended` (which exited on their own) are not listed for having no heartbeat.
    pub fn report(&self, ended: &[usize]) -> String {
        let Ok(s) = self.seen.lock() else {
            return String::new();
        };
        let mut out = String::new();
        for (b, _) in &s.named {
            out.push_str(&format!("  {}\n", b.line()));
        }
        if let Some(stall) = &s.stall {
            out.push_str(&format!("  {}\n", stall.line()));
        }
        let mut ranks = String::new();
        for (rank, beat) in s.beats.iter().enumerate() {
            let Some(beat) = beat else {
                if !ended.contains(&rank) {
                    ranks.push_str(&format!("    rank {rank}: no heartbeat\n"));
                }
                continue;
            };
            let calls: Vec<String> = beat
                .groups
                .iter()
                .map(|g| {
                    format!(
                        "call {} {} on {:?} {}",
                        g.seq,
                        g.op,
                        g.group,
                        state_name(&g.state)
                    )
                })
                .collect();
            let calls = if calls.is_empty() {
                "no collective yet".to_string()
            } else {
                calls.join("; ")
            };
            ranks.push_str(&format!("    rank {rank}: {calls}\n"));
        }
        if s.beats.iter().any(Option::is_some) && !ranks.is_empty() {
            out.push_str("  last heartbeat of each rank (newest call per group):\n");
            out.push_str(&ranks);
        }
        out
    }
}

/// Every rank's heartbeat; None when the store did not answer.
fn read_beats(store: &StoreClient, world: usize) -> Option<Vec<Option<Heartbeat>>> {
    (0..world)
        .map(|r| {
            let bytes = store.get(&format!("{HEARTBEAT_PREFIX}{r}")).ok()?;
            Some(bytes.and_then(|b| serde_json::from_slice(&b).ok()))
        })
        .collect()
}

fn state_name(state: &FlightState) -> String {
    match state {
        FlightState::Queued => "queued".into(),
        FlightState::Started => "in progress".into(),
        FlightState::Finished => "finished".into(),
        FlightState::Failed(e) => format!("failed: {e}"),
    }
}

/// The flight dumps (`flight-rank<R>.json`) the workers wrote to `dir` since `since`,
/// summarised: each rank's last calls. Unreadable files are named, not skipped silently.
pub fn collect_dumps(dir: &Path, since: SystemTime) -> String {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return String::new();
    };
    let mut files: Vec<_> = entries
        .filter_map(Result::ok)
        .filter(|e| {
            e.metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since)
        })
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("flight-rank") && n.ends_with(".json"))
        })
        .collect();
    files.sort();
    let mut out = String::new();
    for path in files {
        let dump = std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<FlightDump>(&b).map_err(|e| e.to_string()));
        match dump {
            Ok(d) => {
                out.push_str(&format!(
                    "  rank {} flight recorder ({}):\n",
                    d.rank,
                    path.display()
                ));
                let first = d.entries.len().saturating_sub(DUMP_CALLS_SHOWN);
                for e in &d.entries[first..] {
                    out.push_str(&format!(
                        "    call {} {} on {:?} ({} bytes) {}\n",
                        e.seq,
                        e.op,
                        e.group,
                        e.bytes,
                        state_name(&e.state)
                    ));
                }
            }
            Err(e) => out.push_str(&format!("  {}: unreadable ({e})\n", path.display())),
        }
    }
    out
}
