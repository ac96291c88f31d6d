//! How oflaunch tells which rank failed: a stopped (SIGSTOP) rank is named within seconds,
//! not at --timeout.

mod common;

use std::time::{Duration, Instant};

use common::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn a_stopped_rank_is_named_within_10_seconds() {
    let dir = scratch("sigstop");
    let d = dir.to_str().unwrap();
    let job = {
        let mut cmd = std::process::Command::new(OFLAUNCH);
        cmd.args(["--nproc-per-node", "4", WORKER, "sleep", d]);
        start(cmd)
    };
    let pids = wait_for_pids(&dir, 4, T);
    let rank2: i32 = std::fs::read_to_string(dir.join("pid_2"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let stopped_at = Instant::now();
    // SAFETY: sending SIGSTOP to a worker of this test.
    assert_eq!(unsafe { libc::kill(rank2, libc::SIGSTOP) }, 0);
    let r = job.finish(T);
    let took = r.ended.duration_since(stopped_at);
    eprintln!("stopped rank named after {took:?}");
    assert!(took <= Duration::from_secs(10), "took {took:?}");
    assert_eq!(r.code(), 128 + libc::SIGSTOP, "{}", r.stderr);
    assert!(r.stderr.contains("first failure: rank 2"), "{}", r.stderr);
    assert!(r.stderr.contains("stopped by SIGSTOP"), "{}", r.stderr);
    for pid in pids {
        assert!(!alive(pid), "worker {pid} survived");
    }
}
