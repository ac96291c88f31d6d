//! Rate-limited warnings for refused requests and connections: the first refusal is logged at
//! once, later ones are counted and reported at most once per interval, so a flood cannot turn
//! into a flood of log lines.

use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shortest time between two warnings of one kind.
pub(crate) const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

struct Window {
    last_logged: Option<Instant>,
    /// Refusals since the last warning.
    unreported: u64,
}

/// Counts refusals of one kind and logs them at a bounded rate.
pub(crate) struct RefusalLog {
    what: &'static str,
    window: Mutex<Window>,
}

impl RefusalLog {
    pub fn new(what: &'static str) -> RefusalLog {
        RefusalLog {
            what,
            window: Mutex::new(Window {
                last_logged: None,
                unreported: 0,
            }),
        }
    }

    /// Counts one refusal from `peer`; logs a warning when none was logged in the last
    /// interval. Returns whether it logged.
    pub fn record(&self, peer: IpAddr) -> bool {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        w.unreported += 1;
        let due = w
            .last_logged
            .is_none_or(|t| t.elapsed() >= REFUSAL_LOG_INTERVAL);
        if !due {
            return false;
        }
        let count = std::mem::take(&mut w.unreported);
        w.last_logged = Some(Instant::now());
        tracing::warn!(
            latest_peer = %peer,
            count,
            "{} (at most one such warning every {}s)",
            self.what,
            REFUSAL_LOG_INTERVAL.as_secs()
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn a_flood_logs_once_per_interval() {
        let log = RefusalLog::new("test refusals");
        let peer = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert!(log.record(peer), "the first refusal is logged");
        let logged = (0..10_000).filter(|_| log.record(peer)).count();
        assert_eq!(logged, 0, "no more warnings within the interval");
        let w = log.window.lock().unwrap();
        assert_eq!(w.unreported, 10_000);
    }
}
