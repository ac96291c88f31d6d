//! Identical stderr lines of several ranks, printed once: a line a rank writes to stderr is held
//! on its way to the console (up to `HOLD`) for the same line from the other ranks shown there,
//! then printed once as `[ranks 0-3] line` (`[rank 2] line` when no other rank wrote it). It is
//! printed early once every rank still writing has sent it. An error every rank hits alike is
//! then one line with the rank list. Each rank's lines keep their order; a line that starts
//! with a time stamp (a log line) merges with the same line of another rank whatever its stamp.

use std::collections::{BTreeSet, VecDeque};
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::progress::ConsoleBar;
use crate::summary::ranks_text;

/// How long a rank's stderr line waits for the same line from the other ranks.
pub const HOLD: Duration = Duration::from_secs(1);
/// Most lines held at once: beyond it the oldest is printed at once (a flood of lines that
/// differ would otherwise make every new line's search slow).
const MAX_HELD: usize = 1024;

/// A line waiting for its twins.
struct Held {
    /// What lines must equal to merge (the line without a leading time stamp).
    key: Vec<u8>,
    /// The first rank's line, ending in a newline.
    line: Vec<u8>,
    ranks: Vec<usize>,
    since: Instant,
}

#[derive(Default)]
struct State {
    pending: VecDeque<Held>,
    /// Ranks whose stderr is still open.
    open: BTreeSet<usize>,
}

/// The console's stderr merger, shared by every rank's stderr reader.
pub struct LineMerger {
    state: Mutex<State>,
    wake: Condvar,
    bar: Option<ConsoleBar>,
}

impl std::fmt::Debug for LineMerger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LineMerger")
    }
}

impl LineMerger {
    /// A merger printing above `bar` (if any), with a thread that prints held lines when their
    /// time is up (it ends within a second of the merger's drop).
    pub fn start(bar: Option<ConsoleBar>) -> std::io::Result<Arc<LineMerger>> {
        let merger = Arc::new(LineMerger {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            bar,
        });
        let weak: Weak<LineMerger> = Arc::downgrade(&merger);
        std::thread::Builder::new()
            .name("oflaunch-merge".into())
            .spawn(move || {
                while let Some(m) = weak.upgrade() {
                    let mut state = m.lock();
                    m.print_ready(&mut state, false);
                    let wait = state.pending.front().map_or(HOLD, |h| {
                        (h.since + HOLD).saturating_duration_since(Instant::now())
                    });
                    let _ = m
                        .wake
                        .wait_timeout(state, wait.max(Duration::from_millis(1)));
                }
            })?;
        Ok(merger)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rank `rank`'s stderr opened (its worker started).
    pub fn open(&self, rank: usize) {
        self.lock().open.insert(rank);
    }

    /// Rank `rank`'s stderr reached its end: its twins are no longer waited for.
    pub fn close(&self, rank: usize) {
        let mut state = self.lock();
        state.open.remove(&rank);
        self.print_ready(&mut state, false);
    }

    /// A line (ending in a newline) of rank `rank`'s stderr.
    pub fn push(&self, rank: usize, line: &[u8]) {
        let key = without_time_stamp(line).to_vec();
        let mut state = self.lock();
        // Only after this rank's last held line, so its lines keep their order.
        let after = state
            .pending
            .iter()
            .rposition(|h| h.ranks.contains(&rank))
            .map_or(0, |i| i + 1);
        match state.pending.iter_mut().skip(after).find(|h| h.key == key) {
            Some(h) => h.ranks.push(rank),
            None => state.pending.push_back(Held {
                key,
                line: line.to_vec(),
                ranks: vec![rank],
                since: Instant::now(),
            }),
        }
        self.print_ready(&mut state, false);
        self.wake.notify_one();
    }

    /// Prints every held line now (the job ended; a summary follows).
    pub fn flush(&self) {
        let mut state = self.lock();
        self.print_ready(&mut state, true);
    }

    /// Prints the held lines, oldest first, while the oldest is due: every rank still writing
    /// sent it, it waited `HOLD`, or too many are held (or `all`).
    fn print_ready(&self, state: &mut State, all: bool) {
        let now = Instant::now();
        while let Some(h) = state.pending.front() {
            let complete = state.open.iter().all(|r| h.ranks.contains(r));
            let crowded = state.pending.len() > MAX_HELD;
            if !(all || complete || crowded || now.duration_since(h.since) >= HOLD) {
                break;
            }
            let Some(mut h) = state.pending.pop_front() else {
                break;
            };
            h.ranks.sort_unstable();
            let prefix = match h.ranks.as_slice() {
                [one] => format!("[rank {one}] "),
                many => format!("[ranks {}] ", ranks_text(many)),
            };
            let mut out = prefix.into_bytes();
            out.extend_from_slice(&h.line);
            match &self.bar {
                Some(b) => b.write(&out, false),
                None => {
                    let _ = std::io::stderr().lock().write_all(&out);
                }
            }
        }
    }
}

/// `line` without a leading RFC 3339 time stamp (`2026-11-29T01:14:30.493368Z  INFO ...`) and
/// the blanks after it.
fn without_time_stamp(line: &[u8]) -> &[u8] {
    let stamp = line.len() > 11
        && line[..4].iter().all(u8::is_ascii_digit)
        && line[4] == b'-'
        && line[7] == b'-'
        && line[10] == b'T';
    if !stamp {
        return line;
    }
    let end = line
        .iter()
        .position(|b| b.is_ascii_whitespace())
        .unwrap_or(line.len());
    let rest = &line[end..];
    let blanks = rest.iter().take_while(|b| **b == b' ').count();
    &rest[blanks..]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(m: &LineMerger) -> Vec<(String, Vec<usize>)> {
        m.lock()
            .pending
            .iter()
            .map(|h| {
                (
                    String::from_utf8_lossy(&h.line).into_owned(),
                    h.ranks.clone(),
                )
            })
            .collect()
    }

    #[test]
    fn alike_lines_merge_in_each_ranks_order() {
        let m = LineMerger {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            bar: None,
        };
        for r in 0..3 {
            m.open(r);
        }
        m.push(0, b"a\n");
        m.push(0, b"b\n");
        m.push(1, b"b\n");
        m.push(1, b"a\n");
        // Rank 1's "b" joins rank 0's; its later "a" cannot join rank 0's earlier one.
        assert_eq!(
            held(&m),
            vec![
                ("a\n".into(), vec![0]),
                ("b\n".into(), vec![0, 1]),
                ("a\n".into(), vec![1])
            ]
        );
        // Log lines merge whatever their time stamps.
        m.push(2, b"2026-11-29T01:14:30.1Z  WARN x\n");
        m.push(0, b"2026-11-29T01:14:31.9Z  WARN x\n");
        assert_eq!(held(&m).last().unwrap().1, vec![2, 0]);
        // A line every open rank sent is printed at once (here: after the older ones).
        m.close(1);
        m.close(2);
        m.flush();
        assert!(held(&m).is_empty());
        assert_eq!(without_time_stamp(b"2026-11-29 x"), b"2026-11-29 x");
        // A flood of lines that differ is held only up to the bound.
        m.open(1);
        for i in 0..MAX_HELD + 100 {
            m.push(0, format!("line {i}\n").as_bytes());
        }
        assert_eq!(held(&m).len(), MAX_HELD);
        m.flush();
    }
}
