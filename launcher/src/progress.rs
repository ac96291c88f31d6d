//! The progress bar oflaunch draws on its terminal for a worker: rank 0 of a job started with
//! `OXIFLOW_PROGRESS=1` (set when oflaunch's stdout is a terminal) writes lines
//! `@oxiflow-progress POS LEN MESSAGE` instead of drawing a bar into a pipe; oflaunch turns them
//! into one bar (steps, elapsed time, ETA) and prints every other console line above it.

use std::io::Write;
use std::sync::{Arc, Mutex};

use indicatif::{ProgressBar, ProgressStyle};

/// The first word of a progress line.
pub const PROGRESS_PREFIX: &str = "@oxiflow-progress ";

/// The console's bar, made on the first progress line.
#[derive(Clone, Debug, Default)]
pub struct ConsoleBar(Arc<Mutex<Option<ProgressBar>>>);

impl ConsoleBar {
    /// Updates the bar from a progress line (`POS LEN MESSAGE`); false if `line` is not one.
    pub fn update(&self, line: &str) -> bool {
        let Some(rest) = line.trim_end().strip_prefix(PROGRESS_PREFIX) else {
            return false;
        };
        let mut w = rest.splitn(3, ' ');
        let (Some(Ok(pos)), Some(Ok(len))) = (
            w.next().map(str::parse::<u64>),
            w.next().map(str::parse::<u64>),
        ) else {
            return false;
        };
        let msg = w.next().unwrap_or("").to_string();
        let mut bar = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let b = bar.get_or_insert_with(|| {
            let b = ProgressBar::new(len);
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} elapsed {elapsed} eta {eta} {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        });
        b.set_length(len);
        b.set_position(pos);
        b.set_message(msg);
        true
    }

    /// Writes `out` to the console (stdout or stderr) above the bar.
    pub fn write(&self, out: &[u8], stdout: bool) {
        let bar = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let write = || {
            let _ = if stdout {
                std::io::stdout().lock().write_all(out)
            } else {
                std::io::stderr().lock().write_all(out)
            };
        };
        match bar.as_ref() {
            Some(b) => b.suspend(write),
            None => write(),
        }
    }

    /// Removes the bar (the run it showed ended).
    pub fn finish(&self) {
        if let Some(b) = self.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_drive_the_bar() {
        let bar = ConsoleBar::default();
        assert!(!bar.update("step 3 loss 2.0"));
        assert!(!bar.update("@oxiflow-progress x 10 loss"));
        assert!(bar.update("@oxiflow-progress 3 10 loss 2.0\n"));
        let b = bar.0.lock().unwrap().clone().unwrap();
        assert_eq!((b.position(), b.length()), (3, Some(10)));
        assert_eq!(b.message(), "loss 2.0");
        bar.finish();
        assert!(bar.0.lock().unwrap().is_none());
    }
}
