//! Helpers shared by oflaunch's integration tests: running oflaunch with a deadline, scratch
//! directories, pid liveness checks.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const OFLAUNCH: &str = env!("CARGO_BIN_EXE_oflaunch");
pub const WORKER: &str = env!("CARGO_BIN_EXE_oflaunch_testworker");

/// A command line written as one string, split at white space into its arguments; arguments
/// that are empty or hold white space are written as lists.
pub fn argv(line: &'static str) -> Vec<&'static str> {
    line.split_ascii_whitespace().collect()
}

/// A fresh, empty scratch directory.
pub fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "oflaunch_test_{}_{}_{}",
        name,
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A file holding `token`, readable by this user only (for `--token-file`); lives until the
/// test process ends.
pub fn token_file(token: &str) -> &'static str {
    use std::os::unix::fs::PermissionsExt;
    let path = scratch("token").join("token");
    std::fs::write(&path, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    Box::leak(path.to_str().unwrap().to_string().into_boxed_str())
}

/// Lines of stderr as they came, each with the instant it was read.
pub type TimedLines = std::sync::Arc<std::sync::Mutex<Vec<(Instant, String)>>>;

/// A running oflaunch (or any command) whose output is collected by threads.
pub struct Running {
    pub child: Child,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<()>>,
    lines: TimedLines,
}

/// The end of a run.
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub ended: Instant,
    /// When the process was seen to exit, in ms since the Unix epoch.
    pub ended_ms: u128,
    /// The stderr lines with the instant each was read.
    pub lines: Vec<(Instant, String)>,
}

impl Finished {
    pub fn code(&self) -> i32 {
        self.status.code().unwrap_or(-1)
    }

    /// When the first stderr line containing `text` was read.
    pub fn line_at(&self, text: &str) -> Option<Instant> {
        self.lines
            .iter()
            .find(|(_, l)| l.contains(text))
            .map(|(t, _)| *t)
    }
}

pub fn start(mut cmd: Command) -> Running {
    use std::io::BufRead;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start command");
    let mut o = child.stdout.take().unwrap();
    let e = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = o.read_to_string(&mut s);
        s
    });
    let lines = TimedLines::default();
    let sink = lines.clone();
    let err = std::thread::spawn(move || {
        let mut reader = std::io::BufReader::new(e);
        let mut line = Vec::new();
        while matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            let text = String::from_utf8_lossy(&line).into_owned();
            sink.lock().unwrap().push((Instant::now(), text));
            line.clear();
        }
    });
    Running {
        child,
        out: Some(out),
        err: Some(err),
        lines,
    }
}

impl Running {
    /// Waits up to `timeout`; on timeout kills the process and fails the test.
    pub fn finish(mut self, timeout: Duration) -> Finished {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "command still running after {timeout:?}; its stderr:\n{}",
                    self.stderr_so_far()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let ended = Instant::now();
        let ended_ms = now_ms();
        let stdout = self.out.take().unwrap().join().unwrap();
        self.err.take().unwrap().join().unwrap();
        let lines = std::mem::take(&mut *self.lines.lock().unwrap());
        let stderr = lines.iter().map(|(_, l)| l.as_str()).collect();
        Finished {
            status,
            stdout,
            stderr,
            ended,
            ended_ms,
            lines,
        }
    }

    /// The stderr read so far.
    pub fn stderr_so_far(&self) -> String {
        let lines = self.lines.lock().unwrap();
        lines.iter().map(|(_, l)| l.as_str()).collect()
    }

    /// Waits (up to `timeout`) for a stderr line containing `text`; returns when it was read.
    pub fn wait_line(&self, text: &str, timeout: Duration) -> Instant {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((t, _)) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(_, l)| l.contains(text))
            {
                return *t;
            }
            assert!(
                Instant::now() < deadline,
                "no stderr line with {text:?} within {timeout:?}:\n{}",
                self.stderr_so_far()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// `oflaunch ARGS` with a deadline.
pub fn oflaunch(args: &[&str], timeout: Duration) -> Finished {
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args(args);
    start(cmd).finish(timeout)
}

/// Reads a `KEY=VALUE` file.
pub fn read_kv(path: &Path) -> HashMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Pids recorded by test workers as `pid_<rank>` in `dir`.
pub fn recorded_pids(dir: &Path) -> Vec<i32> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("pid_"))
        .map(|e| {
            std::fs::read_to_string(e.path())
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect()
}

/// Whether a process with this pid runs: kill(pid, 0) succeeds and it is not a zombie (once
/// oflaunch has exited, its reparented children are reaped by init, which in a container may
/// not reap at all).
pub fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the parenthesised command name.
    let state = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some(Some('Z')) | Some(Some('X')))
}

/// Waits until `n` pid files exist in `dir` (workers started), up to `timeout`.
pub fn wait_for_pids(dir: &Path, n: usize, timeout: Duration) -> Vec<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        let pids = recorded_pids(dir);
        if pids.len() >= n {
            return pids;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} workers started",
            pids.len()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The child processes of `pid` (its direct children).
pub fn children_of(pid: u32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .collect()
}

/// Sends `sig` to each pid.
pub fn signal(pids: &[i32], sig: libc::c_int) {
    for &pid in pids {
        // SAFETY: signalling processes this test started.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// The seconds oflaunch reports in "... stopped X s after ..." lines.
pub fn stopped_after(stderr: &str) -> Option<f64> {
    stderr.lines().find_map(|l| {
        l.split("stopped ")
            .nth(1)?
            .split(" s after")
            .next()?
            .parse()
            .ok()
    })
}

/// Fails unless the `n` workers whose pids the job recorded in `dir` are gone.
#[track_caller]
pub fn assert_workers_gone(dir: &Path, n: usize) {
    let pids = recorded_pids(dir);
    assert_eq!(pids.len(), n);
    assert_gone(pids);
}

/// Fails unless every worker of `pids` is gone.
#[track_caller]
pub fn assert_gone(pids: impl IntoIterator<Item = i32>) {
    for pid in pids {
        assert!(!alive(pid), "worker {pid} survived");
    }
}

/// Runs two test workers printing 5 lines each with their logs in `dir`, named by `log_flag`
/// (`--log-dir` or its alias `--log_dir`); `timeout` bounds the run.
pub fn two_printers_logged(log_flag: &str, dir: &Path, timeout: Duration) -> Finished {
    let dir = dir.to_str().unwrap();
    let args = ["--nproc-per-node", "2", log_flag, dir, WORKER, "print", "5"];
    oflaunch(&args, timeout)
}

/// Fails unless the run ended within `limit` of `started`.
#[track_caller]
pub fn ended_within(r: &Finished, started: Instant, limit: Duration) {
    let took = r.ended - started;
    assert!(took < limit, "ended after {took:?}, want under {limit:?}");
}

/// Fails unless the run's stderr contains `text` (showing the stderr).
#[track_caller]
pub fn says(r: &Finished, text: &str) {
    assert!(r.stderr.contains(text), "want {text:?} in:\n{}", r.stderr);
}

/// Fails if the run's stderr contains `text` (showing the stderr).
#[track_caller]
pub fn never_says(r: &Finished, text: &str) {
    assert!(!r.stderr.contains(text), "{text:?} in:\n{}", r.stderr);
}
