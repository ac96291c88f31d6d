//! Naming the rank a collective waits for: every second, oflaunch reads each rank's heartbeat
//! from the store (its flight-recorder progress per communicator group) and, when ranks have
//! waited in a call for `BEHIND_AFTER` while a member of the same group has not entered that
//! call, prints which rank is behind, where it is, and who waits for it. The latest
//! heartbeats and the flight dumps the workers wrote go into the failure summary.

use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use oxiflow_collectives::heartbeat::{Heartbeat, HEARTBEAT_PERIOD, HEARTBEAT_PREFIX};
use oxiflow_collectives::rendezvous::StoreClient;
use oxiflow_collectives::{FlightDump, FlightState};

/// How long ranks wait in a call before the rank they wait for is named.
pub const BEHIND_AFTER: Duration = Duration::from_secs(3);
/// Calls of a rank's flight dump shown in the summary.
const DUMP_CALLS_SHOWN: usize = 3;

/// A rank that others wait for.
#[derive(Debug, Clone, PartialEq)]
pub struct Behind {
    pub rank: usize,
    pub group: Vec<usize>,
    /// The call the others wait in.
    pub seq: u64,
    pub op: String,
    pub waiters: Vec<usize>,
    /// The longest wait so far.
    pub waited: Duration,
    /// The behind rank's newest call in the group (seq, op), if its heartbeat holds one.
    pub last_entered: Option<(u64, String)>,
}

impl Behind {
    pub fn line(&self) -> String {
        let last = match &self.last_entered {
            Some((seq, op)) => format!("last entered call {seq} (op {op})"),
            None => "entered no call of this group yet".to_string(),
        };
        format!(
            "rank {} is behind: {last}, ranks {:?} wait in call {} (op {} on ranks {:?}) for \
             {:.1} s",
            self.rank,
            self.waiters,
            self.seq,
            self.op,
            self.group,
            self.waited.as_secs_f64()
        )
    }
}

/// The ranks that others have waited for at least `after` (`beats[r]`: rank r's latest
/// heartbeat, if any). Each wait is measured by the waiting rank's own clock.
pub fn find_behind(beats: &[Option<Heartbeat>], after: Duration) -> Vec<Behind> {
    let mut found: Vec<Behind> = Vec::new();
    for beat in beats.iter().flatten() {
        for call in beat.groups.iter().filter(|g| g.in_flight()) {
            let waited = Duration::from_millis(beat.unix_ms.saturating_sub(call.started_unix_ms));
            if waited < after {
                continue;
            }
            for &member in call.group.iter().filter(|&&m| m != beat.rank) {
                let theirs = beats
                    .get(member)
                    .and_then(Option::as_ref)
                    .and_then(|b| b.progress_in(&call.group));
                if theirs.is_some_and(|p| p.seq >= call.seq) {
                    continue;
                }
                let last_entered = theirs.map(|p| (p.seq, p.op.clone()));
                match found
                    .iter_mut()
                    .find(|b| b.rank == member && b.group == call.group && b.seq == call.seq)
                {
                    Some(b) => {
                        b.waiters.push(beat.rank);
                        b.waited = b.waited.max(waited);
                    }
                    None => found.push(Behind {
                        rank: member,
                        group: call.group.clone(),
                        seq: call.seq,
                        op: call.op.clone(),
                        waiters: vec![beat.rank],
                        waited,
                        last_entered,
                    }),
                }
            }
        }
    }
    for b in &mut found {
        b.waiters.sort_unstable();
    }
    found
}

#[derive(Default)]
struct Seen {
    beats: Vec<Option<Heartbeat>>,
    /// Every rank named as behind so far, as last printed.
    named: Vec<Behind>,
}

/// The running watcher; it stops when dropped.
pub struct HangWatch {
    seen: Arc<Mutex<Seen>>,
    _stop: mpsc::Sender<()>,
}

impl HangWatch {
    /// Starts reading the heartbeats of ranks `0..world` from `store` (the generation's).
    pub fn start(store: StoreClient, world: usize) -> std::io::Result<HangWatch> {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop, stopped) = mpsc::channel::<()>();
        let seen2 = seen.clone();
        std::thread::Builder::new()
            .name("oflaunch-hangwatch".into())
            .spawn(move || loop {
                let beats = read_beats(&store, world);
                let behind = find_behind(&beats, BEHIND_AFTER);
                if let Ok(mut s) = seen2.lock() {
                    for b in behind {
                        let same_call =
                            |n: &Behind| n.rank == b.rank && n.group == b.group && n.seq == b.seq;
                        match s.named.iter_mut().find(|n| same_call(n)) {
                            Some(n) => *n = b,
                            None => {
                                eprintln!("oflaunch: {}", b.line());
                                s.named.push(b);
                            }
                        }
                    }
                    s.beats = beats;
                }
                match stopped.recv_timeout(HEARTBEAT_PERIOD) {
                    Err(RecvTimeoutError::Timeout) => {}
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                }
            })?;
        Ok(HangWatch { seen, _stop: stop })
    }

    /// The ranks named as behind and every rank's last reported progress, for the summary.
    pub fn report(&self) -> String {
        let Ok(s) = self.seen.lock() else {
            return String::new();
        };
        let mut out = String::new();
        for b in &s.named {
            out.push_str(&format!("  {}\n", b.line()));
        }
        if s.beats.iter().any(Option::is_some) {
            out.push_str("  last heartbeat of each rank (newest call per group):\n");
        }
        for (rank, beat) in s.beats.iter().enumerate() {
            let Some(beat) = beat else {
                out.push_str(&format!("    rank {rank}: no heartbeat\n"));
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
            out.push_str(&format!("    rank {rank}: {calls}\n"));
        }
        out
    }
}

fn read_beats(store: &StoreClient, world: usize) -> Vec<Option<Heartbeat>> {
    (0..world)
        .map(|r| {
            let bytes = store.get(&format!("{HEARTBEAT_PREFIX}{r}")).ok()??;
            serde_json::from_slice(&bytes).ok()
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

#[cfg(test)]
mod tests {
    use super::*;
    use oxiflow_collectives::heartbeat::GroupProgress;

    fn beat(rank: usize, now: u64, calls: &[(&[usize], u64, FlightState, u64)]) -> Heartbeat {
        Heartbeat {
            rank,
            pid: 1,
            unix_ms: now,
            groups: calls
                .iter()
                .map(|(group, seq, state, started)| GroupProgress {
                    group: group.to_vec(),
                    seq: *seq,
                    op: "all_reduce".into(),
                    state: state.clone(),
                    started_unix_ms: *started,
                })
                .collect(),
        }
    }

    #[test]
    fn names_the_rank_that_has_not_entered_the_call() {
        let all: &[usize] = &[0, 1, 2];
        let beats = vec![
            Some(beat(0, 10_000, &[(all, 5, FlightState::Started, 5_000)])),
            Some(beat(1, 10_000, &[(all, 4, FlightState::Finished, 4_000)])),
            Some(beat(2, 10_000, &[(all, 5, FlightState::Started, 6_000)])),
        ];
        let found = find_behind(&beats, Duration::from_secs(3));
        assert_eq!(found.len(), 1, "{found:?}");
        let b = &found[0];
        assert_eq!((b.rank, b.seq, b.waiters.clone()), (1, 5, vec![0, 2]));
        assert_eq!(b.waited, Duration::from_secs(5));
        assert!(b.line().starts_with(
            "rank 1 is behind: last entered call 4 (op all_reduce), ranks [0, 2] wait in call 5"
        ));
        // A short wait names nobody; nor does a group whose members are all in the call.
        assert!(find_behind(&beats, Duration::from_secs(6)).is_empty());
        let level = vec![
            Some(beat(0, 10_000, &[(all, 5, FlightState::Started, 5_000)])),
            Some(beat(1, 10_000, &[(all, 5, FlightState::Started, 5_000)])),
            Some(beat(2, 10_000, &[(all, 5, FlightState::Started, 5_000)])),
        ];
        assert!(find_behind(&level, Duration::from_secs(1)).is_empty());
    }

    #[test]
    fn a_rank_without_a_heartbeat_or_group_is_behind() {
        let pair: &[usize] = &[0, 1];
        let beats = vec![
            Some(beat(0, 9_000, &[(pair, 0, FlightState::Queued, 1_000)])),
            None,
        ];
        let found = find_behind(&beats, Duration::from_secs(3));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].last_entered, None);
        assert!(found[0]
            .line()
            .contains("entered no call of this group yet"));
    }
}
