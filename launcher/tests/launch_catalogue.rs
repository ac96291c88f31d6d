//! The launcher's catalogue of bad situations, each on real processes with the message, the
//! exit code and a time bound asserted: ranks frozen by a debugger (one that never collects
//! their exit) or stopped end the job within about a second of being named.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// Wall-clock limit of a whole case (a bound on hangs, not the measure).
const T: Duration = Duration::from_secs(90);
/// The longest oflaunch may take from naming a frozen rank to exiting ("about a second"; a
/// margin for a loaded machine).
const NAMED_TO_EXIT: Duration = Duration::from_millis(2500);

/// Two paced ranks (light on the CPU) under oflaunch with `--stall-timeout 2`; returns the job
/// and the workers' pids by rank once both are all-reducing.
fn paced_job(dir: &std::path::Path) -> (Running, Vec<i32>) {
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args(["--nproc-per-node", "2", "--backend", "cpu"])
        .args(["--stall-timeout", "2", "--timeout", "60"])
        .args([WORKER, "pace", dir.to_str().unwrap(), "20"]);
    let job = start(cmd);
    wait_for_pids(dir, 2, T);
    for rank in 0..2 {
        job.wait_line(&format!("rank {rank} is pacing"), T);
    }
    let pid = |r: usize| -> i32 {
        let text = std::fs::read_to_string(dir.join(format!("pid_{r}"))).unwrap();
        text.trim().parse().unwrap()
    };
    (job, vec![pid(0), pid(1)])
}

/// Freezes `pid`'s main thread under ptrace (PTRACE_SEIZE, PTRACE_INTERRUPT) from a thread
/// that then never collects it, as a debugger waiting for its user does; the thread lets go
/// (and the kernel detaches) when `release` is dropped. Returns the tracer's thread id.
fn freeze_without_reaping(pid: i32) -> (std::sync::mpsc::Sender<()>, i32) {
    let (tx, rx) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let null = std::ptr::null_mut::<libc::c_void>();
        // SAFETY: PTRACE_SEIZE and PTRACE_INTERRUPT on a worker of this test; no memory is
        // passed (the address and data arguments are null).
        let seized = unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, null, null) } == 0
            // SAFETY: as above.
            && unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, pid, null, null) } == 0;
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let _ = tx.send(seized.then_some(tid));
        let _ = released.recv_timeout(T);
    });
    let tid = rx.recv().unwrap().expect("ptrace the worker");
    (release, tid)
}

fn assert_ended_by(r: &Finished, frozen_at: Instant, named: &str, bound: Duration) {
    let named_at = r
        .line_at(named)
        .unwrap_or_else(|| panic!("never named ({named:?}):\n{}", r.stderr));
    let to_exit = r.ended.duration_since(named_at);
    let total = r.ended.duration_since(frozen_at);
    eprintln!(
        "named {:?} after the freeze; exited {to_exit:?} after naming",
        named_at - frozen_at
    );
    assert!(
        to_exit <= NAMED_TO_EXIT,
        "{to_exit:?} from naming to exit\n{}",
        r.stderr
    );
    assert!(
        total <= bound,
        "{total:?} from the freeze to exit\n{}",
        r.stderr
    );
}

/// A rank frozen by a tracer that never collects its exit (gdb at its prompt): named, killed
/// at once, and not waited for.
#[test]
fn a_rank_held_by_a_tracer_ends_the_job_within_a_second_of_naming_it() {
    let dir = scratch("held");
    let (job, pids) = paced_job(&dir);
    let frozen_at = Instant::now();
    let (release, tracer) = freeze_without_reaping(pids[1]);
    let r = job.finish(T);
    drop(release);
    assert_eq!(r.code(), 124, "{}", r.stderr);
    let named =
        format!("rank 1 is frozen: its main thread is in a ptrace stop (traced by pid {tracer})");
    assert_ended_by(&r, frozen_at, &named, Duration::from_secs(2 + 6));
    assert!(
        r.stderr.contains(&format!(
            "rank 1 (pid {}) is dead; its tracer (pid {tracer}) holds its exit status",
            pids[1]
        )),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("first failure: rank 1 (node 0"),
        "{}",
        r.stderr
    );
    assert!(
        !r.stderr.contains("after SIGTERM; sending SIGKILL"),
        "{}",
        r.stderr
    );
    for pid in pids {
        assert!(!alive(pid), "worker {pid} left running");
    }
}

/// The same under a real gdb in batch mode, busy with a shell command (so it does not collect
/// the killed rank either), when gdb is installed.
#[test]
fn a_rank_under_gdb_ends_the_job_within_a_second_of_naming_it() {
    if Command::new("gdb").arg("--version").output().is_err() {
        eprintln!("SKIP a_rank_under_gdb: gdb is not installed");
        return;
    }
    let dir = scratch("gdb");
    let (job, pids) = paced_job(&dir);
    let frozen_at = Instant::now();
    let mut gdb = Command::new("gdb")
        .args([
            "-q",
            "-batch",
            "-p",
            &pids[1].to_string(),
            "-ex",
            "shell sleep 40",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let r = job.finish(T);
    let _ = gdb.kill();
    let _ = gdb.wait();
    assert_eq!(r.code(), 124, "{}", r.stderr);
    // gdb stops every thread (the heartbeat too) or is seen in its ptrace stop first.
    assert_ended_by(
        &r,
        frozen_at,
        "rank 1 is frozen: ",
        Duration::from_secs(2 + 15),
    );
    assert!(
        r.stderr.contains("first failure: rank 1 (node 0"),
        "{}",
        r.stderr
    );
    assert!(
        !r.stderr.contains("after SIGTERM; sending SIGKILL"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("not reaped"), "{}", r.stderr);
}

/// A rank stopped with SIGSTOP: named within seconds, killed without a grace period.
#[test]
fn a_stopped_rank_ends_the_job_within_a_second_of_naming_it() {
    let dir = scratch("stopped");
    let (job, pids) = paced_job(&dir);
    let frozen_at = Instant::now();
    signal(&pids[1..], libc::SIGSTOP);
    let r = job.finish(T);
    // Named frozen (the stall timeout is 2 s) or stopped for too long (3 s), whichever first.
    let named = if r.stderr.contains("rank 1 is frozen: ") {
        assert_eq!(r.code(), 124, "{}", r.stderr);
        "rank 1 is frozen: "
    } else {
        assert_eq!(r.code(), 128 + libc::SIGSTOP, "{}", r.stderr);
        "stopped by SIGSTOP"
    };
    assert_ended_by(&r, frozen_at, named, Duration::from_secs(3 + 5));
    assert!(
        r.stderr.contains("first failure: rank 1 (node 0"),
        "{}",
        r.stderr
    );
    for pid in pids {
        assert!(!alive(pid), "worker {pid} left running");
    }
}
