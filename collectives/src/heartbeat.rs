//! The rank heartbeat: while a multi-process world lives, a thread writes this rank's
//! flight-recorder progress (per communicator group, the newest call: sequence number, op,
//! state, when it was entered) to the store every `HEARTBEAT_PERIOD`, so a launcher can tell
//! which rank is behind while the others wait in a collective, without waiting for a timeout.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::flight::{unix_ms, FlightEntry, FlightRecorder, FlightState};
use crate::rendezvous::StoreClient;

/// Store key prefix of the heartbeats: `oxiflow/heartbeat/<rank>` under the job's prefix.
pub const HEARTBEAT_PREFIX: &str = "oxiflow/heartbeat/";
/// How often a rank writes its heartbeat.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_secs(1);

/// One rank's progress as its heartbeat reports it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Heartbeat {
    pub rank: usize,
    pub pid: u32,
    /// When it was written, by this rank's clock (waits are measured against it, so clocks
    /// of different hosts need not agree).
    pub unix_ms: u64,
    /// Per communicator group, the newest recorded call (groups in order of first use in the
    /// recorder's ring).
    pub groups: Vec<GroupProgress>,
}

/// The newest call a rank made on one communicator group.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GroupProgress {
    pub group: Vec<usize>,
    pub seq: u64,
    pub op: String,
    pub state: FlightState,
    pub started_unix_ms: u64,
    /// The peer of a send or receive, or the root of a rooted collective, as an index into
    /// `group`.
    #[serde(default)]
    pub peer: Option<usize>,
}

impl GroupProgress {
    /// Whether the call was entered and has not returned.
    pub fn in_flight(&self) -> bool {
        matches!(self.state, FlightState::Queued | FlightState::Started)
    }
}

impl Heartbeat {
    /// The progress recorded in `entries` (oldest first; tensor-layer steps are skipped).
    pub fn from_entries(rank: usize, entries: &[FlightEntry], unix_ms: u64) -> Heartbeat {
        let mut groups: Vec<GroupProgress> = Vec::new();
        for e in entries.iter().filter(|e| !e.boxing) {
            let progress = GroupProgress {
                group: e.group.clone(),
                seq: e.seq,
                op: e.op.clone(),
                state: e.state.clone(),
                started_unix_ms: e.started_unix_ms,
                peer: e.peer,
            };
            match groups.iter_mut().find(|g| g.group == e.group) {
                Some(g) => *g = progress,
                None => groups.push(progress),
            }
        }
        Heartbeat {
            rank,
            pid: std::process::id(),
            unix_ms,
            groups,
        }
    }

    /// This process's heartbeat now, from `recorder`.
    pub fn now(rank: usize, recorder: &FlightRecorder) -> Heartbeat {
        Heartbeat::from_entries(rank, &recorder.snapshot(), unix_ms())
    }

    /// The newest call of `group`, if the heartbeat holds one.
    pub fn progress_in(&self, group: &[usize]) -> Option<&GroupProgress> {
        self.groups.iter().find(|g| g.group == group)
    }
}

/// The running heartbeat thread; it stops (within one period, without blocking the caller)
/// when this is dropped.
pub(crate) struct HeartbeatThread {
    _stop: mpsc::Sender<()>,
}

/// Starts writing `rank`'s heartbeat to `store` every `HEARTBEAT_PERIOD`. A write that fails
/// is logged at debug level and retried at the next period (a lost store is the launcher's
/// business, and the data plane reports lost peers itself). None if the thread cannot start.
pub(crate) fn start(store: StoreClient, rank: usize) -> Option<HeartbeatThread> {
    let (stop, stopped) = mpsc::channel::<()>();
    let key = format!("{HEARTBEAT_PREFIX}{rank}");
    let spawned = std::thread::Builder::new()
        .name(format!("oxiflow-heartbeat-{rank}"))
        .spawn(move || loop {
            let beat = Heartbeat::now(rank, crate::flight_recorder());
            match serde_json::to_vec(&beat) {
                Ok(bytes) => {
                    if let Err(e) = store.set(&key, &bytes) {
                        tracing::debug!("heartbeat of rank {rank}: {e}");
                    }
                }
                Err(e) => tracing::debug!("heartbeat of rank {rank}: encoding: {e}"),
            }
            match stopped.recv_timeout(HEARTBEAT_PERIOD) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
        });
    match spawned {
        Ok(_) => Some(HeartbeatThread { _stop: stop }),
        Err(e) => {
            tracing::warn!("rank {rank}: cannot start the heartbeat thread: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, op: &str, group: &[usize], state: FlightState, boxing: bool) -> FlightEntry {
        FlightEntry {
            seq,
            op: op.into(),
            group: group.to_vec(),
            dtype: "f32".into(),
            bytes: 4,
            peer: None,
            state,
            started_unix_ms: 1000 + seq,
            finished_unix_ms: None,
            boxing,
        }
    }

    #[test]
    fn keeps_the_newest_call_per_group_and_skips_boxing() {
        let entries = [
            entry(0, "all_reduce", &[0, 1], FlightState::Finished, false),
            entry(0, "all_gather", &[0, 2], FlightState::Finished, false),
            entry(1, "all_reduce", &[0, 1], FlightState::Started, false),
            entry(7, "boxing S(0)->B", &[0, 1], FlightState::Started, true),
        ];
        let beat = Heartbeat::from_entries(0, &entries, 5000);
        assert_eq!(beat.groups.len(), 2);
        let g = beat.progress_in(&[0, 1]).unwrap();
        assert_eq!((g.seq, g.op.as_str()), (1, "all_reduce"));
        assert!(g.in_flight());
        assert!(!beat.progress_in(&[0, 2]).unwrap().in_flight());
        let json = serde_json::to_string(&beat).unwrap();
        assert_eq!(serde_json::from_str::<Heartbeat>(&json).unwrap(), beat);
    }
}
