//! What a person watching sees: rank 0's progress bar (steps done, elapsed time, ETA, the
//! latest loss) when its output is a terminal, with the log's lines printed above it; under
//! an oflaunch whose output is a terminal (`launcher_bar`), progress lines from which oflaunch
//! draws the bar (`@oxiflow-progress POS LEN MESSAGE`, at most every 100 ms).

use std::cell::Cell;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often progress lines are written for oflaunch.
const LINE_EVERY: Duration = Duration::from_millis(100);

/// Rank 0's lines and, on a terminal, its bar.
pub struct Progress {
    lead: bool,
    bar: Option<ProgressBar>,
    /// Progress lines for oflaunch's bar: the run's length and when the last one went out.
    lines: Option<(u64, Cell<Option<Instant>>)>,
}

impl Progress {
    /// For a run of `steps` steps from step `at`; `lead`: this rank prints; `launcher_bar`:
    /// oflaunch draws the bar from progress lines.
    pub fn new(lead: bool, steps: u64, at: u64, launcher_bar: bool) -> Progress {
        let bar = (lead && std::io::stdout().is_terminal()).then(|| {
            let b = ProgressBar::new(steps);
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} elapsed {elapsed} eta {eta} {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_position(at);
            b
        });
        let lines = (lead && bar.is_none() && launcher_bar).then(|| (steps, Cell::new(None)));
        Progress { lead, bar, lines }
    }

    /// Prints `line` (rank 0 only), above the bar.
    pub fn say(&self, line: impl AsRef<str>) {
        if !self.lead {
            return;
        }
        match &self.bar {
            Some(b) => b.println(line.as_ref()),
            None => println!("{}", line.as_ref()),
        }
    }

    /// The bar at step `n` with the latest loss.
    pub fn at(&self, n: u64, loss: f64) {
        if let Some(b) = &self.bar {
            b.set_position(n);
            b.set_message(format!("loss {loss:.4}"));
        }
        if let Some((steps, last)) = &self.lines {
            if n == *steps || last.get().is_none_or(|t| t.elapsed() >= LINE_EVERY) {
                println!("@oxiflow-progress {n} {steps} loss {loss:.4}");
                last.set(Some(Instant::now()));
            }
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
