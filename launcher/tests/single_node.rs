//! oflaunch on one node with real worker processes: the env contract, failures and their
//! summaries, signals, log files, console filtering, port picking, program resolution.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn four_workers_succeed_with_the_env_contract() {
    let dir = scratch("env");
    let d = dir.to_str().unwrap();
    // By name: found beside oflaunch in the target directory.
    let r = oflaunch(
        &[
            "--nproc_per_node",
            "4",
            "--backend",
            "cpu",
            "--timeout",
            "42",
            "oflaunch_testworker",
            "env",
            d,
        ],
        T,
    );
    assert_eq!(r.code(), 0, "stderr:\n{}", r.stderr);
    let mut ports = Vec::new();
    let mut tokens = Vec::new();
    for rank in 0..4 {
        let kv = read_kv(&dir.join(format!("rank_{rank}.env")));
        assert_eq!(kv["RANK"], rank.to_string());
        assert_eq!(kv["LOCAL_RANK"], rank.to_string());
        assert_eq!(kv["WORLD_SIZE"], "4");
        assert_eq!(kv["LOCAL_WORLD_SIZE"], "4");
        assert_eq!(kv["NODE_RANK"], "0");
        assert_eq!(kv["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(kv["OXIFLOW_BACKEND"], "cpu");
        assert_eq!(kv["OXIFLOW_TIMEOUT"], "42");
        assert_eq!(kv["OXIFLOW_RESTART_COUNT"], "0");
        assert!(!kv["OMP_NUM_THREADS"].is_empty());
        let port: u16 = kv["MASTER_PORT"].parse().unwrap();
        assert_ne!(port, 0);
        ports.push(port);
        tokens.push(kv["OXIFLOW_TOKEN"].clone());
        assert!(!alive(kv["PID"].parse().unwrap()));
    }
    assert!(ports.windows(2).all(|w| w[0] == w[1]), "{ports:?}");
    assert!(tokens.windows(2).all(|w| w[0] == w[1]));
    assert!(tokens[0].len() >= 32, "token {:?}", tokens[0]);
}

#[test]
fn workers_meet_in_the_store_on_a_picked_port_and_a_wrong_token_is_refused() {
    let dir = scratch("store");
    let d = dir.to_str().unwrap();
    let r = oflaunch(
        &[
            "--nproc-per-node",
            "3",
            "--master-port",
            "0",
            WORKER,
            "store",
            d,
        ],
        T,
    );
    assert_eq!(r.code(), 0, "stderr:\n{}", r.stderr);
    for rank in 0..3 {
        let v = std::fs::read_to_string(dir.join(format!("rank_{rank}.store"))).unwrap();
        assert_eq!(v.trim(), "ok values=3 wrong_token_refused=true");
    }
}

#[test]
fn a_worker_exiting_3_stops_the_job_within_2s() {
    let dir = scratch("exit3");
    let d = dir.to_str().unwrap();
    let r = oflaunch(&["--nproc-per-node", "4", WORKER, "fail", d, "2", "3"], T);
    assert_eq!(r.code(), 3, "stderr:\n{}", r.stderr);
    let failed_at: u128 = std::fs::read_to_string(dir.join("failed_at_ms"))
        .unwrap()
        .parse()
        .unwrap();
    let took = r.ended_ms.saturating_sub(failed_at);
    assert!(took < 2000, "oflaunch took {took} ms after the failure");
    says(&r, "first failure: rank 2");
    says(&r, "exit code 3");
    // Its lines are on the console once, not again in the summary.
    says(&r, "[rank 2] the failure reason is 3\n");
    never_says(&r, "| the failure reason is 3");
    assert_workers_gone(&dir, 4);
}

#[test]
fn a_worker_killed_by_sigkill_gives_137_and_a_summary() {
    let dir = scratch("kill9");
    let d = dir.to_str().unwrap();
    let r = oflaunch(
        &["--nproc-per-node", "3", WORKER, "fail", d, "1", "kill9"],
        T,
    );
    assert_eq!(r.code(), 137, "stderr:\n{}", r.stderr);
    says(&r, "first failure: rank 1");
    says(&r, "SIGKILL");
    says(&r, "[rank 1] rank 1 about to fail\n");
    never_says(&r, "| rank 1 about to fail");
    assert_gone(recorded_pids(&dir));
}

fn sigterm_case(ignore_term: bool) {
    let dir = scratch("sigterm");
    let d = dir.to_str().unwrap();
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args([
        "--nproc-per-node",
        "3",
        "--grace-period",
        "1.5",
        WORKER,
        "sleep",
        d,
    ]);
    if ignore_term {
        cmd.arg("ignore-term");
    }
    let run = start(cmd);
    let pids = wait_for_pids(&dir, 3, T);
    let sent = Instant::now();
    // SAFETY: signalling the child we started.
    unsafe {
        libc::kill(run.child.id() as i32, libc::SIGTERM);
    }
    let r = run.finish(T);
    let took = r.ended - sent;
    assert_eq!(r.code(), 143, "stderr:\n{}", r.stderr);
    // Within the grace period (plus scheduling slack on a busy 2-core machine).
    let limit = if ignore_term { 1500 + 1000 } else { 1000 };
    assert!(took.as_millis() < limit, "took {took:?}");
    assert_gone(pids);
}

#[test]
fn sigterm_to_oflaunch_stops_every_worker() {
    sigterm_case(false);
}

#[test]
fn workers_ignoring_sigterm_are_killed_after_the_grace_period() {
    sigterm_case(true);
}

#[test]
fn log_dir_files_and_quiet_console() {
    let dir = scratch("logs");
    let logs = dir.join("logs");
    let r = two_printers_logged("--log_dir", &logs, T);
    assert_eq!(r.code(), 0, "stderr:\n{}", r.stderr);
    assert!(
        !r.stdout.contains("[rank"),
        "console not quiet: {}",
        r.stdout
    );
    for rank in 0..2 {
        let out = std::fs::read_to_string(logs.join(format!("rank_{rank}.stdout"))).unwrap();
        let want: String = (0..5)
            .map(|i| format!("line {i} from rank {rank}\n"))
            .collect();
        assert_eq!(out, want);
        let err = std::fs::read_to_string(logs.join(format!("rank_{rank}.stderr"))).unwrap();
        assert_eq!(err, format!("err from rank {rank}\n"));
    }
}

#[test]
fn tee_with_ranks_filter_prints_whole_prefixed_lines_of_chosen_ranks() {
    let dir = scratch("tee");
    let logs = dir.join("logs");
    let r = oflaunch(
        &[
            "--nproc-per-node",
            "4",
            "--log-dir",
            logs.to_str().unwrap(),
            "--tee",
            "--ranks-filter",
            "0,2",
            WORKER,
            "print",
            "300",
        ],
        T,
    );
    assert_eq!(r.code(), 0, "stderr:\n{}", r.stderr);
    let mut counts = [0usize; 4];
    for line in r.stdout.lines() {
        let rest = line.strip_prefix("[rank ").expect(line);
        let (prefix_rank, text) = rest.split_once("] ").expect(line);
        let rank: usize = prefix_rank.parse().unwrap();
        assert!(
            text.starts_with("line ") && text.ends_with(&format!(" from rank {rank}")),
            "{line}"
        );
        counts[rank] += 1;
    }
    assert_eq!(counts, [300, 0, 300, 0]);
    // Log files get every rank.
    let out3 = std::fs::read_to_string(logs.join("rank_3.stdout")).unwrap();
    assert_eq!(out3.lines().count(), 300);
}

#[test]
fn program_by_path_on_path_and_a_clear_error_when_missing() {
    let dir = scratch("resolve");
    let d = dir.to_str().unwrap();
    let script = format!("echo $RANK > {d}/by_$0_$RANK");
    let r = oflaunch(
        &["--nproc-per-node", "2", "/bin/sh", "-c", &script, "path"],
        T,
    );
    assert_eq!(r.code(), 0, "stderr:\n{}", r.stderr);
    let r = oflaunch(&["--nproc-per-node", "2", "sh", "-c", &script, "name"], T);
    assert_eq!(r.code(), 0, "stderr:\n{}", r.stderr);
    for rank in 0..2 {
        assert!(dir.join(format!("by_path_{rank}")).exists());
        assert!(dir.join(format!("by_name_{rank}")).exists());
    }
    let r = oflaunch(&["no_such_program_xyz"], T);
    assert_eq!(r.code(), 2);
    assert!(
        r.stderr
            .contains("cannot find program \"no_such_program_xyz\""),
        "{}",
        r.stderr
    );
    let target = std::path::Path::new(OFLAUNCH).parent().unwrap();
    assert!(
        r.stderr
            .contains(&target.join("examples").display().to_string()),
        "{}",
        r.stderr
    );
}

#[test]
fn a_taken_port_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let r = oflaunch(&["--master-port", &port, "true"], T);
    assert_eq!(r.code(), 2);
    says(&r, "cannot serve the store");
    says(&r, &port);
}

#[test]
fn max_restarts_restarts_the_group() {
    let dir = scratch("restart");
    let d = dir.to_str().unwrap();
    let script = format!(
        "echo x >> {d}/gen_$OXIFLOW_RESTART_COUNT; \
         if [ \"$OXIFLOW_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then exit 5; fi; exit 0"
    );
    let r = oflaunch(
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "sh",
            "-c",
            &script,
        ],
        T,
    );
    assert_eq!(r.code(), 0, "stderr:\n{}", r.stderr);
    says(&r, "restarting the workers (1/2)");
    assert!(dir.join("gen_1").exists());
    assert!(!dir.join("gen_2").exists());
    // Without restarts left the failure is final.
    let r = oflaunch(
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "sh",
            "-c",
            "exit 4",
        ],
        T,
    );
    assert_eq!(r.code(), 4, "stderr:\n{}", r.stderr);
    says(&r, "giving up after 1 restart(s)");
}

#[test]
fn workers_die_with_a_sigkilled_oflaunch() {
    let dir = scratch("orphans");
    let d = dir.to_str().unwrap();
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args(["--nproc-per-node", "3", WORKER, "sleep", d, "ignore-term"]);
    let run = start(cmd);
    let pids = wait_for_pids(&dir, 3, T);
    // SAFETY: signalling the child we started.
    unsafe {
        libc::kill(run.child.id() as i32, libc::SIGKILL);
    }
    let r = run.finish(T);
    assert_eq!(
        r.status.code(),
        None,
        "oflaunch should have died by SIGKILL"
    );
    let deadline = Instant::now() + Duration::from_secs(2);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    for pid in pids {
        assert!(
            !alive(pid),
            "worker {pid} outlived oflaunch (parent-death signal)"
        );
    }
}
