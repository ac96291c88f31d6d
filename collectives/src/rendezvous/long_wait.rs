//! Long waits say what they wait for: a wait that lasts longer than `NOTICE_EVERY` prints one
//! line to stderr every `NOTICE_EVERY`, naming what it waits for, how long it has waited and
//! the limit that ends it (and the flag or variable that sets that limit), so no wait of a job
//! is silent for longer than that.

use std::time::{Duration, Instant};

/// How often a long wait says what it waits for.
pub const NOTICE_EVERY: Duration = Duration::from_secs(10);

/// One wait's notices.
#[derive(Debug, Clone)]
pub struct LongWait {
    started: Instant,
    next: Instant,
    limit: Duration,
    limit_name: &'static str,
}

impl LongWait {
    /// A wait starting now that gives up after `limit`, set by `limit_name` (a flag or an
    /// environment variable, named in the notices).
    pub fn new(limit: Duration, limit_name: &'static str) -> LongWait {
        let started = Instant::now();
        LongWait {
            started,
            next: started + NOTICE_EVERY,
            limit,
            limit_name,
        }
    }

    /// How long the caller may block before the next notice is due.
    pub fn until_next(&self) -> Duration {
        self.next.saturating_duration_since(Instant::now())
    }

    /// The notice due now, if one is: `what` (what is waited for) with the time waited and the
    /// limit.
    pub fn due(&mut self, what: impl FnOnce() -> String) -> Option<String> {
        let now = Instant::now();
        if now < self.next {
            return None;
        }
        while self.next <= now {
            self.next += NOTICE_EVERY;
        }
        Some(format!(
            "{}; waited {:.0} s of at most {:.0} s ({})",
            what(),
            now.duration_since(self.started).as_secs_f64(),
            self.limit.as_secs_f64(),
            self.limit_name
        ))
    }

    /// Prints the notice due now, if one is (see `due`).
    pub fn tick(&mut self, what: impl FnOnce() -> String) {
        if let Some(line) = self.due(what) {
            eprintln!("{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_is_due_every_period_and_names_the_limit() {
        let mut w = LongWait::new(Duration::from_secs(300), "--timeout");
        assert!(w.due(|| "node 0 waits for node 1".into()).is_none());
        assert!(w.until_next() <= NOTICE_EVERY);
        w.next = Instant::now();
        let line = w.due(|| "node 0 waits for node 1".into()).unwrap();
        assert!(
            line.starts_with("node 0 waits for node 1; waited ")
                && line.ends_with(" s of at most 300 s (--timeout)"),
            "{line}"
        );
        assert!(w.due(|| unreachable!()).is_none());
        assert!(w.until_next() > NOTICE_EVERY - Duration::from_secs(1));
    }
}
