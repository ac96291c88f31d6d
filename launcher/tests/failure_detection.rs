//! How oflaunch tells which rank failed: a stopped (SIGSTOP) rank is named within seconds,
//! not at --timeout; a rank behind in a collective is named from the heartbeats; a rank
//! killed by a resource limit is reported with the limit; the job's temporary flight
//! directories do not outlive it.

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
    says(&r, "first failure: rank 2");
    says(&r, "stopped by SIGSTOP");
    assert_gone(pids);
}

/// A rank busy outside any collective (sleeping before its call 2, not stopped) while the
/// others wait in that call: oflaunch names it, its last call and the waiting ranks within
/// 10 s of the start, and when the waiters time out the summary carries every rank's
/// heartbeat and the flight dumps of the ranks that failed.
#[test]
fn a_rank_behind_in_a_collective_is_named_within_10_seconds() {
    use std::io::{BufRead, BufReader};
    use std::sync::mpsc::RecvTimeoutError;

    let t0 = Instant::now();
    let mut child = std::process::Command::new(OFLAUNCH)
        .args(argv("--nproc-per-node 3 --backend cpu --timeout 8"))
        .args([WORKER, "allreduce", "4", "1", "2", "40"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut stderr = String::new();
    let mut named_after = None;
    let deadline = t0 + T;
    loop {
        match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                if named_after.is_none() && line.starts_with("oflaunch: rank 1 is behind") {
                    named_after = Some(t0.elapsed());
                }
                stderr.push_str(&line);
                stderr.push('\n');
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                panic!("oflaunch still running after {T:?}\n{stderr}");
            }
        }
    }
    let status = child.wait().unwrap();
    eprintln!("{stderr}");
    // The job's flight dumps were summarised, then removed with their directory.
    let flight = std::env::temp_dir().join(format!("oflaunch-flight-{}", child.id()));
    assert!(!flight.exists(), "{} left behind", flight.display());
    let named_after = named_after.expect("rank 1 was never named as behind");
    eprintln!("rank 1 named as behind after {named_after:?}");
    assert!(named_after <= Duration::from_secs(10), "{named_after:?}");
    assert!(
        stderr.contains("rank 1 is behind: last entered call 1 (op all_reduce), ranks [0, 2] wait in call 2 (op all_reduce on ranks [0, 1, 2])"),
        "{stderr}"
    );
    assert_ne!(status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("state of the ranks when the job ended"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rank 1: call 1 all_reduce on [0, 1, 2] finished"),
        "{stderr}"
    );
    assert!(stderr.contains("rank 0 flight recorder ("), "{stderr}");
}

#[test]
fn resource_deaths_are_named_with_the_limit() {
    let dir = scratch("rlimit");
    let big = dir.join("big");
    let fsize = format!(
        "ulimit -f 1 && exec head -c 100000 /dev/zero > '{}'",
        big.display()
    );
    let r = oflaunch(&["--nproc-per-node", "1", "sh", "-c", &fsize], T);
    assert_eq!(r.code(), 128 + libc::SIGXFSZ, "{}", r.stderr);
    assert!(
        r.stderr.contains(
            "killed by SIGXFSZ (signal 25, exit 153): it exceeded its file-size limit \
             (RLIMIT_FSIZE, `ulimit -f`: 512 bytes)"
        ),
        "{}",
        r.stderr
    );
    // The soft CPU limit sends SIGXCPU; a hard one reached kills with SIGKILL.
    let soft = "ulimit -S -t 1 && exec sh -c 'while :; do :; done'";
    let r = oflaunch(&["--nproc-per-node", "1", "sh", "-c", soft], T);
    assert_eq!(r.code(), 128 + libc::SIGXCPU, "{}", r.stderr);
    // The CPU seconds /proc reports are sampled per clock tick, a little under the limit at
    // times.
    let used: f64 = r
        .stderr
        .split("it exceeded its soft CPU-time limit (RLIMIT_CPU, `ulimit -t`) after using ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{}", r.stderr));
    assert!((0.8..2.0).contains(&used), "{used}\n{}", r.stderr);
    let hard = "ulimit -t 1 && exec sh -c 'while :; do :; done'";
    let r = oflaunch(&["--nproc-per-node", "1", "sh", "-c", hard], T);
    assert_eq!(r.code(), 128 + libc::SIGKILL, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("it reached its hard CPU-time limit (RLIMIT_CPU, `ulimit -Ht`: 1 s"),
        "{}",
        r.stderr
    );
}

#[test]
fn flight_directories_of_dead_launchers_are_removed() {
    let dead = std::process::Command::new("true").spawn().unwrap();
    let pid = dead.id();
    let mut dead = dead;
    dead.wait().unwrap();
    let stale = std::env::temp_dir().join(format!("oflaunch-flight-{pid}"));
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("flight-rank0.json"), b"{}").unwrap();
    let r = oflaunch(&["--nproc-per-node", "1", "true"], T);
    assert_eq!(r.code(), 0, "{}", r.stderr);
    assert!(!stale.exists(), "{} left behind", stale.display());
}
