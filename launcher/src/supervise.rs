//! Supervising one generation of local workers: reap them as they exit (a death by a resource
//! limit or the OOM killer explained), tear the group down (SIGTERM to every process group,
//! SIGKILL after the grace period, at once to a frozen one) on the first failure (after
//! `ALIKE_WINDOW`, in which ranks failing alike end on their own and are listed), a rank
//! declared frozen, a forwarded signal, or a failure reported by another node. Every wait has
//! a deadline, and one longer than 10 s says which workers it waits for.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
use oxiflow_collectives::rendezvous::LongWait;

use crate::procfs::{dead_but_held, limits_of, main_thread_frozen, resource_death, Limits};
use crate::rendezvous_join::RemoteEvent;
use crate::signals::SignalPipe;
use crate::spawn::Worker;
use crate::stall::Stall;
use crate::summary::{ExitKind, Failure, STOPPED_LIMIT};

/// How often the loop wakes up to reap workers.
const TICK: Duration = Duration::from_millis(20);
/// How long to wait for a worker's pipes to close after it exited.
const DRAIN: Duration = Duration::from_secs(2);
/// How long to wait for SIGKILLed processes to be reaped before giving up.
const AFTER_KILL: Duration = Duration::from_secs(10);
/// After a worker's exit, how long the others may take to end on their own before they are
/// stopped: ranks that hit the same error exit within it, each with its message whole.
pub const ALIKE_WINDOW: Duration = Duration::from_millis(500);

/// Why a generation ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Every worker exited with code 0.
    Success,
    /// A local worker failed first.
    Failed(Failure),
    /// Another node reported a failure first.
    Remote(Failure),
    /// The rendezvous store became unreachable (node 0 gone or frozen); it last answered at
    /// the instant given.
    StoreLost(String, Instant),
    /// oflaunch received this signal (and forwarded it).
    Interrupted(Signal),
}

/// What the loop needs besides the workers.
pub struct Supervision<'a> {
    pub signals: &'a SignalPipe,
    pub grace: Duration,
    pub node_rank: usize,
    pub nproc_per_node: usize,
    pub host: String,
    /// Polled every tick: a failure reported through the store, if any.
    pub remote: &'a dyn Fn() -> Option<RemoteEvent>,
    /// Polled every tick: a rank declared frozen (on any node), if any.
    pub stalled: &'a dyn Fn() -> Option<Stall>,
}

struct Teardown {
    /// While the others may still end on their own (after a worker's exit): when the stop
    /// signal goes out. None once it went out.
    stop_at: Option<Instant>,
    killed_at: Instant,
    sigkill_sent: bool,
    /// The first signal sent to every worker.
    first: Signal,
    /// Says every 10 s which workers oflaunch still waits for.
    notice: LongWait,
}

impl Teardown {
    /// Sends SIGTERM to every worker still running (SIGKILL to a stopped or ptrace-stopped
    /// one, which acts on no other signal) and starts the grace period.
    fn begin(workers: &[Worker], grace: Duration) -> Teardown {
        for w in workers {
            if main_thread_frozen(w.pid.as_raw()).is_some() {
                let _ = killpg(w.pid, Signal::SIGKILL);
            }
        }
        signal_all(workers, Signal::SIGTERM);
        Teardown::started(grace, Signal::SIGTERM)
    }

    /// The teardown of workers just sent `first`.
    fn started(grace: Duration, first: Signal) -> Teardown {
        Teardown {
            stop_at: None,
            killed_at: Instant::now(),
            sigkill_sent: false,
            first,
            notice: LongWait::new(
                grace + AFTER_KILL,
                "--grace-period, then 10 s after SIGKILL",
            ),
        }
    }

    /// After a worker's exit: the others get `ALIKE_WINDOW` to end on their own (an error every
    /// rank hit alike ends them all, each saying so whole) before `begin`.
    fn after_exit(grace: Duration) -> Teardown {
        Teardown {
            stop_at: Some(Instant::now() + ALIKE_WINDOW),
            ..Teardown::started(grace, Signal::SIGTERM)
        }
    }

    /// Says which workers are still waited for, when a notice is due.
    fn tick(&mut self, workers: &[Worker]) {
        let signal = if self.sigkill_sent {
            Signal::SIGKILL
        } else {
            self.first
        };
        self.notice.tick(|| {
            let ranks: Vec<String> = workers
                .iter()
                .map(|w| format!("{} (pid {})", w.rank, w.pid))
                .collect();
            format!(
                "oflaunch: waiting for rank(s) {} to exit after {signal}",
                ranks.join(", ")
            )
        });
    }
}

/// How a generation ended, and which local ranks ended on their own (before oflaunch stopped
/// them).
#[derive(Debug)]
pub struct Supervised {
    pub outcome: Outcome,
    pub on_their_own: Vec<usize>,
}

/// Runs the workers to the end. Returns the outcome once every worker is reaped (or, after
/// SIGKILL, the reap deadline has passed, which is logged).
pub fn supervise(mut workers: Vec<Worker>, sup: &Supervision<'_>) -> Supervised {
    let mut outcome: Option<Outcome> = None;
    let mut teardown: Option<Teardown> = None;
    let mut stopped = StopWatch::default();
    // Local ranks that ended before any signal of oflaunch, and how.
    let mut ended: Vec<(usize, ExitKind)> = Vec::new();
    let finish = |outcome: Option<Outcome>, ended: Vec<(usize, ExitKind)>| {
        let mut outcome = outcome.unwrap_or(Outcome::Success);
        if let Outcome::Failed(f) = &mut outcome {
            f.alike = ended
                .iter()
                .filter(|(_, e)| *e == f.exit)
                .map(|(r, _)| *r)
                .collect();
            f.alike.sort_unstable();
        }
        Supervised {
            outcome,
            on_their_own: ended.into_iter().map(|(r, _)| r).collect(),
        }
    };
    loop {
        // Signals to oflaunch; an exiting worker wakes the loop at once.
        let pidfds: Vec<RawFd> = workers
            .iter()
            .filter_map(|w| w.pidfd.as_ref().map(AsRawFd::as_raw_fd))
            .collect();
        let (signals, exited) = sup.signals.wait(&pidfds, TICK);
        // Those seen exiting by the wake-up come first: when several exit at nearly the same
        // time, the first failure is the one that woke the loop, not the first in list order.
        workers.sort_by_key(|w| {
            !w.pidfd
                .as_ref()
                .is_some_and(|fd| exited.contains(&fd.as_raw_fd()))
        });
        for sig in signals {
            let settling = teardown.as_ref().is_some_and(|t| t.stop_at.is_some());
            if outcome.is_none() || settling {
                tracing::warn!("received {sig}; forwarding it to the workers");
                if outcome.is_none() {
                    outcome = Some(Outcome::Interrupted(sig));
                }
                signal_all(&workers, sig);
                teardown = Some(Teardown::started(sup.grace, sig));
            } else if teardown.as_ref().is_some_and(|t| !t.sigkill_sent) {
                tracing::warn!("received {sig} again; killing the workers now");
                signal_all(&workers, Signal::SIGKILL);
                if let Some(t) = teardown.as_mut() {
                    t.sigkill_sent = true;
                    t.killed_at = Instant::now();
                }
            }
        }

        // Reap whoever exited (those whose exit woke the loop first).
        let signalled = teardown.as_ref().is_some_and(|t| t.stop_at.is_none());
        let mut failed: Vec<Failure> = Vec::new();
        let mut i = 0;
        while i < workers.len() {
            // Read before the reap, while /proc still has the exited worker.
            let limits = has_exited(&workers[i])
                .then(|| limits_of(workers[i].pid.as_raw()))
                .flatten();
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
            let w = workers.remove(i);
            let rank = w.rank;
            let (exit, failure) = reap(w, status, limits, sup);
            if !signalled {
                ended.push((rank, exit));
            }
            failed.extend(failure);
        }
        // Once the job is being torn down, a worker that died but whose tracer (a debugger
        // that froze it) has not collected its exit is done: waiting for the tracer could take
        // as long as its user does.
        if teardown.is_some() {
            workers.retain_mut(|w| match dead_but_held(w.pid.as_raw()) {
                Some(tracer) => {
                    eprintln!(
                        "oflaunch: rank {} (pid {}) is dead; its tracer (pid {tracer}) holds its \
                         exit status, so oflaunch does not wait for it",
                        w.rank, w.pid
                    );
                    if let Some(p) = w.pipes.take() {
                        p.drain(DRAIN);
                    }
                    false
                }
                None => true,
            });
        }
        if let Some(first) = failed.into_iter().next() {
            if outcome.is_none() {
                tracing::error!(
                    rank = first.rank,
                    "worker failed ({}); stopping the others",
                    first.exit
                );
                outcome = Some(Outcome::Failed(first));
                teardown = Some(Teardown::after_exit(sup.grace));
            }
        }

        if workers.is_empty() {
            return finish(outcome, ended);
        }

        // A worker stopped for too long fails the job like one that exited.
        if outcome.is_none() {
            if let Some((i, sig)) = stopped.too_long(&workers) {
                let w = &workers[i];
                let exit = ExitKind::Stopped(sig as i32);
                tracing::error!(rank = w.rank, "worker {exit}; stopping the others");
                // A stopped process acts on no signal but SIGKILL.
                let _ = killpg(w.pid, Signal::SIGKILL);
                let tail = w
                    .pipes
                    .as_ref()
                    .and_then(|p| p.tail.lock().ok().map(|t| t.iter().cloned().collect()))
                    .unwrap_or_default();
                outcome = Some(Outcome::Failed(failure_of(
                    w.rank, w.pid, exit, None, tail, sup,
                )));
                teardown = Some(Teardown::begin(&workers, sup.grace));
            }
        }

        // A rank declared frozen (here or on another node) fails the job.
        if outcome.is_none() {
            if let Some(stall) = (sup.stalled)() {
                tracing::error!("rank {} is frozen; stopping the workers", stall.rank);
                outcome = Some(Outcome::Failed(stall_failure(&stall, &workers, sup)));
                teardown = Some(Teardown::begin(&workers, sup.grace));
            }
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
                    RemoteEvent::StoreLost {
                        message,
                        last_answer,
                    } => {
                        tracing::error!("{message}; stopping the local workers");
                        Outcome::StoreLost(message, last_answer)
                    }
                });
                teardown = Some(Teardown::begin(&workers, sup.grace));
            }
        }

        // Stop the others once the window for ending alike has passed; escalate; and never
        // wait forever.
        if let Some(t) = teardown.as_mut() {
            if let Some(at) = t.stop_at {
                if Instant::now() >= at {
                    *t = Teardown::begin(&workers, sup.grace);
                }
                continue;
            }
            t.tick(&workers);
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
                return finish(outcome, ended);
            }
        }
    }
}

/// The failure of a rank declared frozen; a local one is killed at once (a frozen process acts
/// on no other signal).
fn stall_failure(stall: &Stall, workers: &[Worker], sup: &Supervision<'_>) -> Failure {
    let local = workers.iter().find(|w| w.rank == stall.rank);
    if let Some(w) = local {
        let _ = killpg(w.pid, Signal::SIGKILL);
    }
    let tail = local
        .and_then(|w| w.pipes.as_ref())
        .and_then(|p| p.tail.lock().ok().map(|t| t.iter().cloned().collect()))
        .unwrap_or_default();
    let node_rank = stall.rank / sup.nproc_per_node.max(1);
    Failure {
        rank: stall.rank,
        node_rank,
        host: if local.is_some() {
            sup.host.clone()
        } else {
            format!("of node {node_rank}")
        },
        pid: local.map_or_else(|| stall.pid.map_or(0, |p| p as i32), |w| w.pid.as_raw()),
        exit: ExitKind::Stalled(stall.silent.as_millis() as u64),
        cause: Some(format!(
            "{}; ranks {:?} wait for it in {}",
            stall.why, stall.waiters, stall.call
        )),
        tail,
        alike: Vec::new(),
    }
}

/// Whether `w` has exited (not yet reaped).
fn has_exited(w: &Worker) -> bool {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    matches!(
        waitid(Id::Pid(w.pid), flags),
        Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..))
    )
}

/// Closes the book on a worker that exited: kills what is left of its process group, drains
/// its output; returns how it ended and its failure, if it failed, explained by a resource limit when one was
/// hit (`limits`: the worker's, read before it was reaped).
fn reap(
    mut w: Worker,
    status: std::process::ExitStatus,
    limits: Option<Limits>,
    sup: &Supervision<'_>,
) -> (ExitKind, Option<Failure>) {
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
    if exit.is_success() {
        return (exit, None);
    }
    let cause = match exit {
        ExitKind::Signal(sig) => resource_death(sig, limits.as_ref(), Some(&w.oom)),
        _ => None,
    };
    (
        exit,
        Some(failure_of(w.rank, w.pid, exit, cause, tail, sup)),
    )
}

/// A local worker's failure as the summary reports it.
fn failure_of(
    rank: usize,
    pid: nix::unistd::Pid,
    exit: ExitKind,
    cause: Option<String>,
    tail: Vec<String>,
    sup: &Supervision<'_>,
) -> Failure {
    Failure {
        rank,
        node_rank: sup.node_rank,
        host: sup.host.clone(),
        pid: pid.as_raw(),
        exit,
        cause,
        tail,
        alike: Vec::new(),
    }
}

/// When each worker was first seen stopped (by pid), to tell a stop from a brief pause.
#[derive(Default)]
struct StopWatch {
    since: HashMap<i32, Instant>,
}

impl StopWatch {
    /// The index of a worker stopped for longer than `STOPPED_LIMIT`, with the stop signal.
    fn too_long(&mut self, workers: &[Worker]) -> Option<(usize, Signal)> {
        let mut found = None;
        for (i, w) in workers.iter().enumerate() {
            let flags = WaitPidFlag::WSTOPPED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
            match waitid(Id::Pid(w.pid), flags) {
                Ok(WaitStatus::Stopped(_, sig)) => {
                    let since = *self
                        .since
                        .entry(w.pid.as_raw())
                        .or_insert_with(Instant::now);
                    if found.is_none() && since.elapsed() >= STOPPED_LIMIT {
                        found = Some((i, sig));
                    }
                }
                _ => {
                    self.since.remove(&w.pid.as_raw());
                }
            }
        }
        found
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
