//! How a worker ended, and the failure summary oflaunch prints (rank, host, code or signal,
//! the ranks that ended alike, the tail of its stderr unless the console showed it).

use std::fmt;
use std::process::ExitStatus;
use std::time::Duration;

/// How long a worker may stay stopped (SIGSTOP, SIGTSTP, SIGTTIN/OU) before it counts as
/// failed: the others would wait for it in their next collective until --timeout.
pub const STOPPED_LIMIT: Duration = Duration::from_secs(3);

/// How one worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    Code(i32),
    Signal(i32),
    /// Stopped by this signal (SIGSTOP, SIGTSTP, ...) for longer than oflaunch allows; it was
    /// then killed.
    Stopped(i32),
    /// Frozen (no progress for this many milliseconds) while other ranks waited for it; the
    /// job was ended (see `stall`).
    Stalled(u64),
}

/// The exit code of a job ended because a rank froze.
pub const STALLED_CODE: i32 = 124;

impl ExitKind {
    pub fn from_status(status: ExitStatus) -> ExitKind {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(c), _) => ExitKind::Code(c),
            (None, Some(s)) => ExitKind::Signal(s),
            // Neither code nor signal (stopped/continued is never reported by wait here).
            (None, None) => ExitKind::Code(1),
        }
    }

    pub fn is_success(self) -> bool {
        self == ExitKind::Code(0)
    }

    /// The shell convention: the code, or 128 + signal number.
    pub fn shell_code(self) -> i32 {
        match self {
            ExitKind::Code(c) => c,
            ExitKind::Signal(s) | ExitKind::Stopped(s) => 128 + s,
            ExitKind::Stalled(_) => STALLED_CODE,
        }
    }
}

impl fmt::Display for ExitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = |s: i32| {
            nix::sys::signal::Signal::try_from(s)
                .map(|sig| sig.as_str().to_string())
                .unwrap_or_else(|_| format!("signal {s}"))
        };
        match *self {
            ExitKind::Code(c) => write!(f, "exit code {c}"),
            ExitKind::Signal(s) => {
                write!(f, "killed by {} (signal {s}, exit {})", name(s), 128 + s)
            }
            ExitKind::Stopped(s) => write!(
                f,
                "stopped by {} and not running for {}s; killed (exit {})",
                name(s),
                STOPPED_LIMIT.as_secs(),
                128 + s
            ),
            ExitKind::Stalled(ms) => write!(
                f,
                "frozen: no progress for {:.1} s while other ranks waited for it; the job was \
                 ended (exit {STALLED_CODE})",
                ms as f64 / 1000.0
            ),
        }
    }
}

/// The first failure of a job, local or reported by another node.
#[derive(Debug, Clone)]
pub struct Failure {
    pub rank: usize,
    pub node_rank: usize,
    pub host: String,
    pub pid: i32,
    pub exit: ExitKind,
    /// What explains the exit, when oflaunch knows (a resource limit, the OOM killer, what
    /// froze the rank).
    pub cause: Option<String>,
    /// Last lines of the rank's stderr.
    pub tail: Vec<String>,
    /// The local ranks that ended the same way on their own (before oflaunch stopped them),
    /// this one included; empty when only it did (or another node reported it).
    pub alike: Vec<usize>,
}

impl Failure {
    /// The human summary printed by oflaunch; `tail_shown`: the rank's stderr was printed on
    /// this console already (so its tail is not repeated).
    pub fn summary(&self, remote: bool, tail_shown: bool) -> String {
        let mut s = String::new();
        s.push_str("oflaunch: job failed\n");
        s.push_str(&format!(
            "  first failure: rank {} (node {}, host {}, pid {}): {}{}{}\n",
            self.rank,
            self.node_rank,
            self.host,
            self.pid,
            self.exit,
            self.cause
                .as_deref()
                .map_or_else(String::new, |c| format!(": {c}")),
            if remote {
                " [reported by that node]"
            } else {
                ""
            }
        ));
        if self.alike.len() > 1 {
            s.push_str(&format!(
                "  ranks {} ended alike ({})\n",
                ranks_text(&self.alike),
                self.exit
            ));
        }
        if self.tail.is_empty() {
            s.push_str(&format!("  rank {} wrote nothing to stderr\n", self.rank));
        } else if !tail_shown {
            s.push_str(&format!(
                "  last {} line(s) of rank {}'s stderr:\n",
                self.tail.len(),
                self.rank
            ));
            for line in &self.tail {
                s.push_str("    | ");
                s.push_str(line);
                s.push('\n');
            }
        }
        s
    }

    /// A one-value encoding for the store's "job failed" key.
    pub fn encode(&self) -> String {
        let (kind, n) = match self.exit {
            ExitKind::Code(c) => ("code", i64::from(c)),
            ExitKind::Signal(s) => ("signal", i64::from(s)),
            ExitKind::Stopped(s) => ("stopped", i64::from(s)),
            ExitKind::Stalled(ms) => ("stalled", ms as i64),
        };
        let cause = self.cause.as_deref().unwrap_or("").replace('\n', " ");
        let mut s = format!(
            "{}\n{}\n{}\n{}\n{kind} {n}\ncause:{cause}\n",
            self.rank, self.node_rank, self.host, self.pid
        );
        for line in &self.tail {
            s.push_str(line);
            s.push('\n');
        }
        s
    }

    /// Reads [`Failure::encode`]'s output; None when malformed.
    pub fn decode(s: &str) -> Option<Failure> {
        let mut lines = s.lines();
        let rank = lines.next()?.parse().ok()?;
        let node_rank = lines.next()?.parse().ok()?;
        let host = lines.next()?.to_string();
        let pid = lines.next()?.parse().ok()?;
        let (kind, n) = lines.next()?.split_once(' ')?;
        let n: i64 = n.parse().ok()?;
        let small = || i32::try_from(n).ok();
        let exit = match kind {
            "code" => ExitKind::Code(small()?),
            "signal" => ExitKind::Signal(small()?),
            "stopped" => ExitKind::Stopped(small()?),
            "stalled" => ExitKind::Stalled(u64::try_from(n).ok()?),
            _ => return None,
        };
        let cause = lines.next()?.strip_prefix("cause:")?;
        Some(Failure {
            rank,
            node_rank,
            host,
            pid,
            exit,
            cause: (!cause.is_empty()).then(|| cause.to_string()),
            tail: lines.map(str::to_string).collect(),
            alike: Vec::new(),
        })
    }
}

/// Sorted ranks as runs: `0-3`, `0, 2, 5-7`.
pub fn ranks_text(ranks: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == r => *end = r,
            _ => runs.push((r, r)),
        }
    }
    runs.iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// This machine's host name (for summaries).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_roundtrip_and_codes() {
        let f = Failure {
            rank: 5,
            node_rank: 1,
            host: "h1".into(),
            pid: 42,
            exit: ExitKind::Signal(9),
            cause: Some("the kernel's OOM killer".into()),
            tail: vec!["boom".into(), "bang".into()],
            alike: vec![4, 5, 6],
        };
        let g = Failure::decode(&f.encode()).unwrap();
        assert_eq!(g.rank, 5);
        assert_eq!(g.exit, ExitKind::Signal(9));
        assert_eq!(g.cause, f.cause);
        assert_eq!(g.tail, f.tail);
        let frozen = Failure {
            exit: ExitKind::Stalled(5200),
            cause: None,
            ..f.clone()
        };
        let h = Failure::decode(&frozen.encode()).unwrap();
        assert_eq!((h.exit, h.cause), (ExitKind::Stalled(5200), None));
        assert_eq!(h.exit.shell_code(), STALLED_CODE);
        assert!(frozen
            .summary(false, false)
            .contains("no progress for 5.2 s"));
        assert_eq!(g.exit.shell_code(), 137);
        assert!(f.summary(true, false).contains("rank 5"));
        assert!(f.summary(true, false).contains("SIGKILL"));
        assert!(f.summary(true, false).contains("    | bang\n"));
        assert!(!f.summary(false, true).contains("boom"));
        assert!(f
            .summary(false, true)
            .contains("  ranks 4-6 ended alike (killed by SIGKILL"));
        assert_eq!(ranks_text(&[0, 2, 3, 4, 7]), "0, 2-4, 7");
        assert!(Failure::decode("x").is_none());
    }
}
