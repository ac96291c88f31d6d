//! Supervising one generation of local workers: reap them as they exit, tear the group down
//! (SIGTERM to every process group, SIGKILL after the grace period) on the first failure, a
//! forwarded signal, or a failure reported by another node. Every wait has a deadline.

use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};

use crate::rendezvous_join::RemoteEvent;
use crate::signals::SignalPipe;
use crate::spawn::Worker;
use crate::summary::{ExitKind, Failure};

/// How often the loop wakes up to reap workers.
const TICK: Duration = Duration::from_millis(20);
/// How long to wait for a worker's pipes to close after it exited.
const DRAIN: Duration = Duration::from_secs(2);
/// How long to wait for SIGKILLed processes to be reaped before giving up.
const AFTER_KILL: Duration = Duration::from_secs(10);

/// Why a generation ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Every worker exited with code 0.
    Success,
    /// A local worker failed first.
    Failed(Failure),
    /// Another node reported a failure first.
    Remote(Failure),
    /// The rendezvous store became unreachable (node 0 gone).
    StoreLost(String),
    /// oflaunch received this signal (and forwarded it).
    Interrupted(Signal),
}

/// What the loop needs besides the workers.
pub struct Supervision<'a> {
    pub signals: &'a SignalPipe,
    pub grace: Duration,
    pub node_rank: usize,
    pub host: String,
    /// Polled every tick: a failure reported through the store, if any.
    pub remote: &'a dyn Fn() -> Option<RemoteEvent>,
}

struct Teardown {
    killed_at: Instant,
    sigkill_sent: bool,
}

/// Runs the workers to the end. Returns the outcome once every worker is reaped (or, after
/// SIGKILL, the reap deadline has passed, which is logged).
pub fn supervise(mut workers: Vec<Worker>, sup: &Supervision<'_>) -> Outcome {
    let mut outcome: Option<Outcome> = None;
    let mut teardown: Option<Teardown> = None;
    loop {
        // Signals to oflaunch.
        for sig in sup.signals.wait(TICK) {
            if outcome.is_none() {
                tracing::warn!("received {sig}; forwarding it to the workers");
                outcome = Some(Outcome::Interrupted(sig));
                signal_all(&workers, sig);
                teardown = Some(Teardown {
                    killed_at: Instant::now(),
                    sigkill_sent: false,
                });
            } else if teardown.as_ref().is_some_and(|t| !t.sigkill_sent) {
                tracing::warn!("received {sig} again; killing the workers now");
                signal_all(&workers, Signal::SIGKILL);
                if let Some(t) = teardown.as_mut() {
                    t.sigkill_sent = true;
                    t.killed_at = Instant::now();
                }
            }
        }

        // Reap whoever exited.
        let mut i = 0;
        while i < workers.len() {
            let status = match workers[i].child.try_wait() {
                Ok(Some(status)) => status,
                Ok(None) => {
                    i += 1;
                    continue;
                }
                Err(e) => {
                    tracing::error!(rank = workers[i].rank, "waiting for the worker: {e}");
                    i += 1;
                    continue;
                }
            };
            let mut w = workers.swap_remove(i);
            let exit = ExitKind::from_status(status);
            // Leftover processes of the worker's group go with it: no orphans.
            let _ = killpg(w.pid, Signal::SIGKILL);
            let tail = match w.pipes.take() {
                Some(p) => {
                    let tail = p.tail.clone();
                    p.drain(DRAIN);
                    let t = tail
                        .lock()
                        .map(|t| t.iter().cloned().collect())
                        .unwrap_or_default();
                    t
                }
                None => Vec::new(),
            };
            tracing::debug!(rank = w.rank, pid = w.pid.as_raw(), "worker ended: {exit}");
            if !exit.is_success() && outcome.is_none() {
                tracing::error!(rank = w.rank, "worker failed ({exit}); stopping the others");
                outcome = Some(Outcome::Failed(Failure {
                    rank: w.rank,
                    node_rank: sup.node_rank,
                    host: sup.host.clone(),
                    pid: w.pid.as_raw(),
                    exit,
                    tail,
                }));
                signal_all(&workers, Signal::SIGTERM);
                teardown = Some(Teardown {
                    killed_at: Instant::now(),
                    sigkill_sent: false,
                });
            }
        }

        if workers.is_empty() {
            return outcome.unwrap_or(Outcome::Success);
        }

        // Another node failed.
        if outcome.is_none() {
            if let Some(event) = (sup.remote)() {
                outcome = Some(match event {
                    RemoteEvent::Failed(f) => {
                        tracing::error!(
                            "rank {} on node {} ({}) failed: {}; stopping the local workers",
                            f.rank,
                            f.node_rank,
                            f.host,
                            f.exit
                        );
                        Outcome::Remote(f)
                    }
                    RemoteEvent::StoreLost(msg) => {
                        tracing::error!("{msg}; stopping the local workers");
                        Outcome::StoreLost(msg)
                    }
                });
                signal_all(&workers, Signal::SIGTERM);
                teardown = Some(Teardown {
                    killed_at: Instant::now(),
                    sigkill_sent: false,
                });
            }
        }

        // Escalate, and never wait forever.
        if let Some(t) = teardown.as_mut() {
            if !t.sigkill_sent && t.killed_at.elapsed() >= sup.grace {
                tracing::warn!(
                    "{} worker(s) still running {:?} after SIGTERM; sending SIGKILL",
                    workers.len(),
                    sup.grace
                );
                signal_all(&workers, Signal::SIGKILL);
                t.sigkill_sent = true;
                t.killed_at = Instant::now();
            } else if t.sigkill_sent && t.killed_at.elapsed() >= AFTER_KILL {
                let pids: Vec<i32> = workers.iter().map(|w| w.pid.as_raw()).collect();
                tracing::error!("workers {pids:?} not reaped {AFTER_KILL:?} after SIGKILL");
                return outcome.unwrap_or(Outcome::Success);
            }
        }
    }
}

/// Sends `sig` to the process group of every worker still running.
fn signal_all(workers: &[Worker], sig: Signal) {
    for w in workers {
        if let Err(e) = killpg(w.pid, sig) {
            tracing::debug!(rank = w.rank, "sending {sig} to group {}: {e}", w.pid);
        }
    }
}
