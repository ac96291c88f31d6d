//! Telling a rank that is behind from one that is frozen, from the ranks' heartbeats (and, for
//! local workers, their main thread's state). Pure: the watcher (`hang_watch`) feeds it.
//!
//! A rank is *behind* when others have waited `BEHIND_AFTER` in a call it has not entered: a
//! collective whose sequence number it has not reached, or a receive (or blocking send) whose
//! peer it is and which it is not serving. A behind rank that itself waits for another behind
//! rank is a neighbour, not the cause; the line says so. A rank is *stalled* when others wait
//! for it (in any call of a group it belongs to, entered or not) and it shows no sign of life
//! for the stall timeout: its heartbeat has not changed (the whole process is frozen: SIGSTOP,
//! a debugger, a frozen node) while the store answered, or, on its own node, its main thread
//! has been stopped or ptrace-stopped (a tracer froze it while its heartbeat thread runs). A
//! rank that is merely slow (computing, writing a checkpoint) keeps heartbeating and runs, so
//! it is named behind but never stalled; the waiters' `--timeout` bounds that wait.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use oxiflow_collectives::heartbeat::{GroupProgress, Heartbeat};

use crate::procfs::Frozen;

/// A rank that others wait for.
#[derive(Debug, Clone, PartialEq)]
pub struct Behind {
    pub rank: usize,
    pub group: Vec<usize>,
    /// The call the others wait in.
    pub seq: u64,
    /// Its op (`recv from rank 3` for point-to-point calls).
    pub op: String,
    pub waiters: Vec<usize>,
    /// The longest wait so far.
    pub waited: Duration,
    /// The behind rank's newest call in the group (seq, op), if its heartbeat holds one.
    pub last_entered: Option<(u64, String)>,
    /// The behind rank itself waits for another behind rank (a neighbour of the cause).
    pub waits_too: bool,
}

impl Behind {
    pub fn line(&self) -> String {
        let last = match &self.last_entered {
            Some((seq, op)) => format!("last entered call {seq} (op {op})"),
            None => "entered no call of this group yet".to_string(),
        };
        let too = if self.waits_too {
            "; it waits itself for another rank named here"
        } else {
            ""
        };
        format!(
            "rank {} is behind: {last}, ranks {:?} wait in call {} (op {} on ranks {:?}) for \
             {:.1} s{too}",
            self.rank,
            self.waiters,
            self.seq,
            self.op,
            self.group,
            self.waited.as_secs_f64()
        )
    }
}

fn is_p2p(op: &str) -> bool {
    matches!(op, "send" | "recv")
}

/// The world rank of a call's peer.
fn peer_rank(call: &GroupProgress) -> Option<usize> {
    call.peer.and_then(|p| call.group.get(p).copied())
}

/// The ranks a call of rank `me` waits for: its peer for a send or receive, else the other
/// members of its group.
fn awaited(call: &GroupProgress, me: usize) -> Vec<usize> {
    if is_p2p(&call.op) {
        peer_rank(call).into_iter().filter(|&r| r != me).collect()
    } else {
        call.group.iter().copied().filter(|&m| m != me).collect()
    }
}

fn op_name(call: &GroupProgress) -> String {
    match (is_p2p(&call.op), peer_rank(call)) {
        (true, Some(p)) if call.op == "recv" => format!("recv from rank {p}"),
        (true, Some(p)) => format!("send to rank {p}"),
        _ => call.op.clone(),
    }
}

/// Each in-flight call that has waited at least `after`, with its waiting rank.
fn long_waits(
    beats: &[Option<Heartbeat>],
    after: Duration,
) -> impl Iterator<Item = (usize, &GroupProgress, Duration)> {
    beats.iter().flatten().flat_map(move |beat| {
        beat.groups
            .iter()
            .filter(|g| g.in_flight())
            .map(move |call| {
                let waited =
                    Duration::from_millis(beat.unix_ms.saturating_sub(call.started_unix_ms));
                (beat.rank, call, waited)
            })
            .filter(move |(_, _, waited)| *waited >= after)
    })
}

/// `behind` without the waits of ranks that are frozen themselves (`stopped`): a rank frozen
/// inside a call reports it as a wait, but it waits for nobody, and the ranks it would name
/// are the frozen rank's victims, not its cause.
pub fn without_frozen_waiters(behind: Vec<Behind>, stopped: impl Fn(usize) -> bool) -> Vec<Behind> {
    behind
        .into_iter()
        .filter(|b| !b.waiters.iter().all(|&w| stopped(w)))
        .collect()
}

/// The ranks that others have waited for at least `after` (`beats[r]`: rank r's latest
/// heartbeat, if any). Each wait is measured by the waiting rank's own clock.
pub fn find_behind(beats: &[Option<Heartbeat>], after: Duration) -> Vec<Behind> {
    let mut found: Vec<Behind> = Vec::new();
    for (waiter, call, waited) in long_waits(beats, after) {
        for member in awaited(call, waiter) {
            let theirs = beats
                .get(member)
                .and_then(Option::as_ref)
                .and_then(|b| b.progress_in(&call.group));
            let serving = |p: &GroupProgress| {
                if is_p2p(&call.op) {
                    p.in_flight() && is_p2p(&p.op) && peer_rank(p) == Some(waiter)
                } else {
                    p.seq >= call.seq
                }
            };
            if theirs.is_some_and(serving) {
                continue;
            }
            let last_entered = theirs.map(|p| (p.seq, op_name(p)));
            match found
                .iter_mut()
                .find(|b| b.rank == member && b.group == call.group && b.seq == call.seq)
            {
                Some(b) => {
                    b.waiters.push(waiter);
                    b.waited = b.waited.max(waited);
                }
                None => found.push(Behind {
                    rank: member,
                    group: call.group.clone(),
                    seq: call.seq,
                    op: op_name(call),
                    waiters: vec![waiter],
                    waited,
                    last_entered,
                    waits_too: false,
                }),
            }
        }
    }
    let waiting: Vec<usize> = found.iter().flat_map(|b| b.waiters.clone()).collect();
    for b in &mut found {
        b.waiters.sort_unstable();
        b.waiters.dedup();
        b.waits_too = waiting.contains(&b.rank);
    }
    found
}

/// For each rank others wait for (entered or not): the waiters and one call they wait in.
fn awaited_by(
    beats: &[Option<Heartbeat>],
    after: Duration,
) -> BTreeMap<usize, (Vec<usize>, String)> {
    let mut out: BTreeMap<usize, (Vec<usize>, String)> = BTreeMap::new();
    for (waiter, call, _) in long_waits(beats, after) {
        for member in awaited(call, waiter) {
            let entry = out.entry(member).or_insert_with(|| {
                (
                    Vec::new(),
                    format!(
                        "call {} (op {} on ranks {:?})",
                        call.seq,
                        op_name(call),
                        call.group
                    ),
                )
            });
            if !entry.0.contains(&waiter) {
                entry.0.push(waiter);
            }
        }
    }
    for (waiters, _) in out.values_mut() {
        waiters.sort_unstable();
    }
    out
}

/// A rank declared frozen.
#[derive(Debug, Clone)]
pub struct Stall {
    pub rank: usize,
    /// Other ranks frozen at the same time (a frozen node's), in order.
    pub also: Vec<usize>,
    /// Its pid, from its heartbeat or this node's records.
    pub pid: Option<u32>,
    /// What shows it frozen.
    pub why: String,
    pub waiters: Vec<usize>,
    pub call: String,
    /// When it last showed progress, by this launcher's clock.
    pub last_progress: Instant,
    /// How long it had shown none when declared frozen.
    pub silent: Duration,
}

impl Stall {
    pub fn line(&self) -> String {
        let also = if self.also.is_empty() {
            String::new()
        } else {
            format!(" (ranks {:?} too)", self.also)
        };
        format!(
            "rank {}{also} is frozen: {}, for {:.1} s while ranks {:?} wait for it in {}",
            self.rank,
            self.why,
            self.silent.as_secs_f64(),
            self.waiters,
            self.call
        )
    }
}

/// What the watcher has seen of each rank's progress.
#[derive(Default)]
pub struct Progress {
    /// Per rank: the heartbeat's time stamp and when this launcher saw it change.
    beat: HashMap<usize, (u64, Instant)>,
    /// Whether the last read of the heartbeats failed, and when reads last came back.
    store_down: bool,
    store_back: Option<Instant>,
    /// Local ranks whose main thread is stopped: since when, and how.
    frozen: HashMap<usize, (Instant, Frozen)>,
}

impl Progress {
    /// Whether local rank `rank`'s main thread was last seen stopped (its heartbeat thread
    /// may still report the call it was frozen in as a wait).
    pub fn main_thread_stopped(&self, rank: usize) -> bool {
        self.frozen.contains_key(&rank)
    }
    /// A read of every heartbeat at `now` (None: the store did not answer).
    pub fn observe_beats(&mut self, now: Instant, beats: Option<&[Option<Heartbeat>]>) {
        let Some(beats) = beats else {
            self.store_down = true;
            return;
        };
        if self.store_down {
            self.store_down = false;
            self.store_back = Some(now);
        }
        for b in beats.iter().flatten() {
            match self.beat.get(&b.rank) {
                Some((ms, _)) if *ms == b.unix_ms => {}
                _ => {
                    self.beat.insert(b.rank, (b.unix_ms, now));
                }
            }
        }
    }

    /// The state of local rank `rank`'s main thread at `now`.
    pub fn observe_local(&mut self, now: Instant, rank: usize, state: Option<Frozen>) {
        match state {
            Some(f) => {
                self.frozen.entry(rank).or_insert((now, f));
            }
            None => {
                self.frozen.remove(&rank);
            }
        }
    }

    /// Why `rank` counts as frozen at `now` for at least `limit`, and since when.
    fn evidence(&self, now: Instant, rank: usize, limit: Duration) -> Option<(String, Instant)> {
        if let Some((since, how)) = self.frozen.get(&rank) {
            if now.duration_since(*since) >= limit {
                return Some((how.describe(), *since));
            }
        }
        if self.store_down {
            return None;
        }
        let (_, changed) = self.beat.get(&rank)?;
        let since = self.store_back.map_or(*changed, |b| b.max(*changed));
        (now.duration_since(since) >= limit).then(|| {
            (
                "its heartbeat stopped changing (the whole process is frozen: stopped, \
                 attached by a debugger, or its node frozen)"
                    .to_string(),
                *changed,
            )
        })
    }
}

/// The frozen ranks others wait for (see the module docs), if any: the lowest one, with the
/// others of the same moment in `also`.
pub fn find_stall(
    beats: &[Option<Heartbeat>],
    progress: &Progress,
    now: Instant,
    limit: Duration,
    after: Duration,
) -> Option<Stall> {
    let mut stalls = awaited_by(beats, after)
        .into_iter()
        .filter_map(|(rank, (waiters, call))| {
            let (why, since) = progress.evidence(now, rank, limit)?;
            let pid = beats.get(rank).and_then(Option::as_ref).map(|b| b.pid);
            Some(Stall {
                rank,
                also: Vec::new(),
                pid,
                why,
                waiters,
                call,
                last_progress: since,
                silent: now.duration_since(since),
            })
        })
        .collect::<Vec<_>>()
        .into_iter();
    let mut first = stalls.next()?;
    first.also = stalls.map(|s| s.rank).collect();
    Some(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxiflow_collectives::FlightState;

    type Call<'a> = (&'a [usize], u64, &'a str, Option<usize>, FlightState, u64);

    fn beat(rank: usize, now: u64, calls: &[Call<'_>]) -> Heartbeat {
        Heartbeat {
            rank,
            pid: 100 + rank as u32,
            unix_ms: now,
            groups: calls
                .iter()
                .map(|(group, seq, op, peer, state, started)| GroupProgress {
                    group: group.to_vec(),
                    seq: *seq,
                    op: op.to_string(),
                    state: state.clone(),
                    started_unix_ms: *started,
                    peer: *peer,
                })
                .collect(),
        }
    }

    const ALL: &[usize] = &[0, 1, 2];

    /// The three ranks' heartbeats at 10 s, rank `r` from `calls[r]` = (seq, state, started):
    /// its last call is all-reduce `seq` of all three ranks, in `state` since `started`.
    fn all_reduce_beats(calls: [(u64, FlightState, u64); 3]) -> Vec<Option<Heartbeat>> {
        calls
            .into_iter()
            .enumerate()
            .map(|(rank, (seq, state, started))| {
                Some(beat(
                    rank,
                    10_000,
                    &[(ALL, seq, "all_reduce", None, state, started)],
                ))
            })
            .collect()
    }

    /// `find_behind` after 3 s, checked to name exactly one rank.
    fn one_behind(beats: &[Option<Heartbeat>]) -> Vec<Behind> {
        let found = find_behind(beats, Duration::from_secs(3));
        assert_eq!(found.len(), 1, "{found:?}");
        found
    }

    #[test]
    fn a_frozen_ranks_own_wait_names_nobody() {
        // Rank 2 froze inside call 5; rank 1 never entered it. Only rank 2 "waits" there.
        let found = one_behind(&all_reduce_beats([
            (5, FlightState::Finished, 5_000),
            (4, FlightState::Finished, 4_000),
            (5, FlightState::Started, 5_000),
        ]));
        assert_eq!(found[0].waiters, vec![2]);
        assert!(without_frozen_waiters(found.clone(), |r| r == 2).is_empty());
        assert_eq!(without_frozen_waiters(found, |r| r == 0).len(), 1);
    }

    #[test]
    fn names_the_rank_that_has_not_entered_the_call() {
        let beats = all_reduce_beats([
            (5, FlightState::Started, 5_000),
            (4, FlightState::Finished, 4_000),
            (5, FlightState::Started, 6_000),
        ]);
        let found = one_behind(&beats);
        let b = &found[0];
        assert_eq!((b.rank, b.seq, b.waiters.clone()), (1, 5, vec![0, 2]));
        assert_eq!(b.waited, Duration::from_secs(5));
        assert!(b.line().starts_with(
            "rank 1 is behind: last entered call 4 (op all_reduce), ranks [0, 2] wait in call 5"
        ));
        // A short wait names nobody; nor does a group whose members are all in the call.
        assert!(find_behind(&beats, Duration::from_secs(6)).is_empty());
        let level = all_reduce_beats([0, 1, 2].map(|_| (5, FlightState::Started, 5_000)));
        assert!(find_behind(&level, Duration::from_secs(1)).is_empty());
    }

    #[test]
    fn a_rank_without_a_heartbeat_or_group_is_behind() {
        let pair: &[usize] = &[0, 1];
        let beats = vec![
            Some(beat(
                0,
                9_000,
                &[(pair, 0, "all_reduce", None, FlightState::Queued, 1_000)],
            )),
            None,
        ];
        let found = one_behind(&beats);
        assert_eq!(found[0].last_entered, None);
        assert!(found[0]
            .line()
            .contains("entered no call of this group yet"));
    }

    /// A pipeline: stage 1 (rank 1) froze; rank 0 waits to receive from it, and rank 2 (the
    /// next stage) waits to receive from rank 0. Sequence numbers of point-to-point calls are
    /// per rank, so only the peer counts: rank 1 is the cause, rank 0 a waiting neighbour.
    #[test]
    fn point_to_point_waits_blame_the_peer_and_mark_neighbours() {
        let w: &[usize] = &[0, 1, 2];
        // Rank `rank`'s heartbeat at `now` ms, in one point-to-point call with `peer` on `w`.
        let p2p =
            |rank, now, (seq, op, peer, state, started): (u64, &str, usize, FlightState, u64)| {
                Some(beat(rank, now, &[(w, seq, op, Some(peer), state, started)]))
            };
        let beats = vec![
            p2p(0, 20_000, (40, "recv", 1, FlightState::Started, 10_000)),
            p2p(1, 9_000, (12, "send", 2, FlightState::Finished, 8_000)),
            p2p(2, 20_000, (90, "recv", 0, FlightState::Started, 11_000)),
        ];
        let found = find_behind(&beats, Duration::from_secs(3));
        let by_rank: BTreeMap<usize, &Behind> = found.iter().map(|b| (b.rank, b)).collect();
        assert_eq!(by_rank.keys().copied().collect::<Vec<_>>(), [0, 1]);
        assert!(!by_rank[&1].waits_too);
        assert!(by_rank[&0].waits_too);
        assert!(by_rank[&1]
            .line()
            .contains("(op recv from rank 1 on ranks [0, 1, 2])"));
        assert!(by_rank[&0]
            .line()
            .ends_with("it waits itself for another rank named here"));
        // A receive whose peer is serving it (its send in flight) names nobody.
        let serving = vec![
            p2p(0, 20_000, (40, "recv", 1, FlightState::Started, 10_000)),
            p2p(1, 20_000, (12, "send", 0, FlightState::Started, 19_000)),
            None,
        ];
        assert!(find_behind(&serving, Duration::from_secs(3)).is_empty());
    }

    #[test]
    fn only_a_rank_without_progress_that_others_wait_for_is_stalled() {
        let t0 = Instant::now();
        let limit = Duration::from_secs(5);
        let after = Duration::from_secs(3);
        // Everyone inside one all-reduce; rank 2 entered it and then froze.
        let at = |ms: u64, r: usize| {
            Some(beat(
                r,
                ms,
                &[(ALL, 5, "all_reduce", None, FlightState::Started, 1_000)],
            ))
        };
        let mut p = Progress::default();
        p.observe_beats(t0, Some(&[at(2_000, 0), at(2_000, 1), at(2_000, 2)]));
        let later = t0 + Duration::from_secs(6);
        let beats = [at(8_000, 0), at(8_000, 1), at(2_000, 2)];
        p.observe_beats(later, Some(&beats));
        let s = find_stall(&beats, &p, later, limit, after).expect("rank 2 is frozen");
        assert_eq!(
            (s.rank, s.waiters.clone(), s.pid),
            (2, vec![0, 1], Some(102))
        );
        assert!(
            s.line()
                .contains("rank 2 is frozen: its heartbeat stopped changing"),
            "{}",
            s.line()
        );
        // The store did not answer meanwhile: no verdict, and none until it has answered for
        // the whole limit again.
        p.observe_beats(later, None);
        assert!(find_stall(&beats, &p, later, limit, after).is_none());
        p.observe_beats(later, Some(&beats));
        assert!(find_stall(&beats, &p, later + Duration::from_secs(4), limit, after).is_none());
        assert!(find_stall(&beats, &p, later + Duration::from_secs(5), limit, after).is_some());
        // Heartbeating but its main thread traced: frozen on its own node.
        let mut q = Progress::default();
        q.observe_beats(t0, Some(&beats));
        q.observe_local(t0, 1, Some(Frozen::Traced { tracer: 7 }));
        let fresh = [at(8_000, 0), at(8_000, 1), at(8_000, 2)];
        q.observe_beats(later, Some(&[at(9_000, 0), at(9_000, 1), at(9_000, 2)]));
        let s = find_stall(&fresh, &q, later, limit, after).expect("rank 1 is traced");
        assert_eq!(s.rank, 1);
        assert!(s.why.contains("ptrace stop (traced by pid 7)"));
        // Nobody waiting long enough: no stall, however silent.
        let idle = [
            Some(beat(
                0,
                8_000,
                &[(ALL, 5, "all_reduce", None, FlightState::Finished, 1_000)],
            )),
            None,
            at(2_000, 2),
        ];
        assert!(find_stall(&idle, &p, later + Duration::from_secs(9), limit, after).is_none());
    }
}
