//! What a person watching sees: rank 0's progress bar (steps done, elapsed time, ETA, the
//! latest loss) when its output is a terminal, with the log's lines printed above it.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// Rank 0's lines and, on a terminal, its bar.
pub struct Progress {
    lead: bool,
    bar: Option<ProgressBar>,
}

impl Progress {
    /// For a run of `steps` steps from step `at`; `lead`: this rank prints.
    pub fn new(lead: bool, steps: u64, at: u64) -> Progress {
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
        Progress { lead, bar }
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
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
