//! What `/proc` and the cgroup file system say about a local worker: whether its main thread
//! is stopped (job control) or in a ptrace stop (a debugger, or a tracer that froze it), its
//! resource limits, and its cgroup's OOM-kill count, so that a frozen rank is recognised and a
//! rank killed by a resource limit is reported with the limit.

use std::path::PathBuf;

/// Why a worker's main thread is not running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frozen {
    /// Stopped by a signal (`T`).
    Stopped,
    /// In a ptrace stop (`t`), traced by this pid.
    Traced { tracer: u32 },
}

impl Frozen {
    pub fn describe(&self) -> String {
        match self {
            Frozen::Stopped => "its main thread is stopped (SIGSTOP or a group stop)".into(),
            Frozen::Traced { tracer } => {
                format!("its main thread is in a ptrace stop (traced by pid {tracer})")
            }
        }
    }
}

/// The state letter of a `/proc/.../stat` file (`R`, `S`, `T`, `t`, `Z`, ...).
fn state_in(stat_path: &str) -> Option<char> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    // The state follows the parenthesised command name (which may itself hold parentheses).
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// The pid tracing `pid` (`TracerPid` of its status; 0: none).
fn tracer_of(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The state of `pid`'s main thread when it is stopped or traced-stopped; None when it runs,
/// sleeps or cannot be read.
pub fn main_thread_frozen(pid: i32) -> Option<Frozen> {
    match state_in(&format!("/proc/{pid}/task/{pid}/stat"))? {
        'T' => Some(Frozen::Stopped),
        't' => Some(Frozen::Traced {
            tracer: tracer_of(pid).unwrap_or(0),
        }),
        _ => None,
    }
}

/// The tracer of `pid` when `pid` is dead (a zombie) but traced: its tracer (a debugger) must
/// collect its exit before its parent can, and may never do so while it waits for its user.
pub fn dead_but_held(pid: i32) -> Option<u32> {
    if state_in(&format!("/proc/{pid}/stat"))? != 'Z' {
        return None;
    }
    tracer_of(pid).filter(|&t| t != 0)
}

/// A soft and hard limit of `/proc/PID/limits` (None: unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limit {
    pub soft: Option<u64>,
    pub hard: Option<u64>,
}

/// The limits a resource death is explained with, and the CPU time used.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Limits {
    /// RLIMIT_FSIZE, bytes.
    pub file_size: Limit,
    /// RLIMIT_CPU, seconds.
    pub cpu_time: Limit,
    /// User and system CPU seconds the process used.
    pub cpu_used: Option<f64>,
}

fn parse_value(v: &str) -> Option<u64> {
    v.parse().ok()
}

/// Parses the text of `/proc/PID/limits`.
pub fn parse_limits(text: &str) -> Limits {
    let mut out = Limits::default();
    for line in text.lines() {
        let (slot, rest) = if let Some(r) = line.strip_prefix("Max file size") {
            (&mut out.file_size, r)
        } else if let Some(r) = line.strip_prefix("Max cpu time") {
            (&mut out.cpu_time, r)
        } else {
            continue;
        };
        let mut words = rest.split_whitespace();
        slot.soft = words.next().and_then(parse_value);
        slot.hard = words.next().and_then(parse_value);
    }
    out
}

/// User plus system CPU seconds from the text of `/proc/PID/stat`.
fn cpu_seconds(stat: &str) -> Option<f64> {
    // Fields after the command name: state is field 3, utime 14, stime 15.
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

/// The limits and CPU time of `pid` (a live process or a zombie not yet reaped).
pub fn limits_of(pid: i32) -> Option<Limits> {
    let mut limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))
        .ok()
        .map(|t| parse_limits(&t))?;
    limits.cpu_used = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| cpu_seconds(&s));
    Some(limits)
}

/// The cgroup (v2) directory of `pid`.
pub fn cgroup_of(pid: i32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(PathBuf::from("/sys/fs/cgroup").join(rel.trim_start_matches('/')))
}

/// The `oom_kill` count of a cgroup's `memory.events`.
pub fn oom_kills(cgroup: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(cgroup.join("memory.events")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

/// A cgroup's memory limit as its `memory.max` says (`max` or bytes).
pub fn memory_max(cgroup: &std::path::Path) -> Option<String> {
    std::fs::read_to_string(cgroup.join("memory.max"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// What a worker's cgroup looked like when it started: where it is and its OOM-kill count.
#[derive(Debug, Clone, Default)]
pub struct OomWatch {
    cgroup: Option<PathBuf>,
    kills_at_start: Option<u64>,
}

impl OomWatch {
    pub fn start(pid: i32) -> OomWatch {
        let cgroup = cgroup_of(pid);
        let kills_at_start = cgroup.as_deref().and_then(oom_kills);
        OomWatch {
            cgroup,
            kills_at_start,
        }
    }

    /// The OOM evidence since the start, if the cgroup's count rose.
    pub fn evidence(&self) -> Option<String> {
        let cgroup = self.cgroup.as_deref()?;
        let (before, after) = (self.kills_at_start?, oom_kills(cgroup)?);
        (after > before).then(|| {
            format!(
                "likely the kernel's OOM killer: oom_kill in {}/memory.events rose from \
                 {before} to {after} while it ran (memory.max {})",
                cgroup.display(),
                memory_max(cgroup).unwrap_or_else(|| "unknown".into())
            )
        })
    }
}

fn show(v: Option<u64>, unit: &str) -> String {
    v.map_or_else(|| "unlimited".to_string(), |v| format!("{v} {unit}"))
}

/// Why a worker killed by `signal` died, when a resource limit or the OOM killer explains it.
pub fn resource_death(
    signal: i32,
    limits: Option<&Limits>,
    oom: Option<&OomWatch>,
) -> Option<String> {
    match signal {
        libc::SIGXFSZ => Some(format!(
            "it exceeded its file-size limit (RLIMIT_FSIZE, `ulimit -f`: {})",
            limits.map_or_else(|| "unknown".into(), |l| show(l.file_size.soft, "bytes"))
        )),
        // The kernel raises the soft limit by 1 s each time it sends SIGXCPU, so the time used
        // says more than the limit read afterwards.
        libc::SIGXCPU => Some(match limits.and_then(|l| l.cpu_used) {
            Some(used) => format!(
                "it exceeded its soft CPU-time limit (RLIMIT_CPU, `ulimit -t`) after using \
                 {used:.1} s of CPU"
            ),
            None => "it exceeded its soft CPU-time limit (RLIMIT_CPU, `ulimit -t`)".into(),
        }),
        libc::SIGKILL => {
            let cpu = limits.and_then(|l| Some((l.cpu_time.hard?, l.cpu_used?)));
            match cpu {
                // The CPU time read back runs up to a tenth of a second short of the limit
                // that killed it (per-tick accounting).
                Some((hard, used)) if used + 0.15 + 0.01 * hard as f64 >= hard as f64 => {
                    Some(format!(
                    "it reached its hard CPU-time limit (RLIMIT_CPU, `ulimit -Ht`: {hard} s; it \
                     used {used:.1} s)"
                    ))
                }
                _ => oom.and_then(OomWatch::evidence),
            }
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_limits() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max cpu time              2                    unlimited            seconds   \n\
                    Max file size             4096                 8192                 bytes     \n";
        let l = parse_limits(text);
        assert_eq!(
            l.cpu_time,
            Limit {
                soft: Some(2),
                hard: None
            }
        );
        assert_eq!(
            l.file_size,
            Limit {
                soft: Some(4096),
                hard: Some(8192)
            }
        );
        let why = resource_death(libc::SIGXFSZ, Some(&l), None).unwrap();
        assert!(
            why.contains("RLIMIT_FSIZE, `ulimit -f`: 4096 bytes"),
            "{why}"
        );
        let why = resource_death(libc::SIGXCPU, Some(&l), None).unwrap();
        assert!(
            why.contains("soft CPU-time limit (RLIMIT_CPU, `ulimit -t`)"),
            "{why}"
        );
        assert_eq!(resource_death(libc::SIGSEGV, Some(&l), None), None);
        assert_eq!(resource_death(libc::SIGKILL, Some(&l), None), None);
        let spent = Limits {
            cpu_time: Limit {
                soft: Some(1),
                hard: Some(1),
            },
            cpu_used: Some(1.0),
            ..l
        };
        let why = resource_death(libc::SIGKILL, Some(&spent), None).unwrap();
        assert!(
            why.contains("hard CPU-time limit (RLIMIT_CPU, `ulimit -Ht`: 1 s"),
            "{why}"
        );
        assert!(cpu_seconds("1 (a b) R 1 2 3 4 5 6 7 8 9 10 200 100 0").is_some());
    }

    #[test]
    fn sees_its_own_main_thread_running() {
        assert_eq!(main_thread_frozen(std::process::id() as i32), None);
        assert!(limits_of(std::process::id() as i32).is_some());
    }
}
