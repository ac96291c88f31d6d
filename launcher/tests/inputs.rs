//! oflaunch's inputs: the job token only from a file or the environment, and every flag
//! checked before anything starts, with a message naming the flag.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn a_token_on_the_command_line_is_refused() {
    let dir = scratch("argv_token");
    let r = oflaunch(&["--token", "abc", WORKER, "env", dir.to_str().unwrap()], T);
    assert_eq!(r.code(), 2, "{}", r.stderr);
    says(&r, "--token-file");
    says(&r, "/proc/PID/cmdline");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a worker ran");
}

#[test]
fn the_token_file_reaches_the_workers_and_no_command_line() {
    let dir = scratch("token_file");
    let d = dir.to_str().unwrap();
    let token = "file-token-0123456789abcdef0123456789abcdef";
    let file = token_file(token);
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args([
        "--nproc-per-node",
        "2",
        "--token-file",
        file,
        WORKER,
        "env",
        d,
    ])
    .env_remove("OXIFLOW_TOKEN");
    let r = start(cmd).finish(T);
    assert_eq!(r.code(), 0, "{}", r.stderr);
    for rank in 0..2 {
        let kv = read_kv(&dir.join(format!("rank_{rank}.env")));
        assert_eq!(kv["OXIFLOW_TOKEN"], token);
        // oflaunch's command line, readable by every user, does not carry it.
        let launcher = &kv["PARENT_CMDLINE"];
        assert!(launcher.contains("--token-file"), "{launcher}");
        assert!(!launcher.contains(token), "{launcher}");
    }
}

#[test]
fn the_token_from_the_environment_reaches_the_workers() {
    let dir = scratch("token_env");
    let d = dir.to_str().unwrap();
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args(["--nproc-per-node", "2", WORKER, "env", d])
        .env("OXIFLOW_TOKEN", "env-token-0123456789");
    let r = start(cmd).finish(T);
    assert_eq!(r.code(), 0, "{}", r.stderr);
    let kv = read_kv(&dir.join("rank_1.env"));
    assert_eq!(kv["OXIFLOW_TOKEN"], "env-token-0123456789");
}

/// oflaunch with `args` must refuse to start (exit 2) with a message containing `expect`,
/// before any worker runs.
fn refused(args: &[&str], expect: &str) {
    let dir = scratch("refused");
    let mut all: Vec<&str> = args.to_vec();
    all.extend([WORKER, "env", dir.to_str().unwrap()]);
    let r = oflaunch(&all, T);
    assert_eq!(r.code(), 2, "{args:?}: {}", r.stderr);
    assert!(r.stderr.contains(expect), "{args:?}: {}", r.stderr);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "{args:?}: a worker ran"
    );
}

#[test]
fn bad_flag_values_are_refused_before_any_worker_starts() {
    const POSITIVE_TIMEOUT: &str = "--timeout must be a positive number";
    const POSITIVE_STALL: &str = "--stall-timeout must be a positive number";
    // (the flags, what the refusal says)
    let cases: &[(&[&str], &str)] = &[
        (
            &["--nproc-per-node", "100000"],
            "--nproc-per-node 100000 exceeds",
        ),
        (
            &["--nproc-per-node", "0"],
            "--nproc-per-node must be at least 1",
        ),
        (&["--nproc-per-node", "-1"], "--nproc-per-node \"-1\""),
        (&["--nproc-per-node", "2x"], "expected a positive count"),
        (&["--nnodes", "0"], "--nnodes must be at least 1"),
        (&["--nnodes", "-2"], "invalid value '-2' for '--nnodes"),
        (
            &["--nnodes", "2", "--node-rank", "2"],
            "--node-rank 2 is out of range",
        ),
        (&["--timeout", "0"], POSITIVE_TIMEOUT),
        (&["--timeout", "-5"], POSITIVE_TIMEOUT),
        (&["--timeout", "nan"], POSITIVE_TIMEOUT),
        (&["--timeout", "inf"], POSITIVE_TIMEOUT),
        (
            &["--grace-period", "0"],
            "--grace-period must be a positive number",
        ),
        (&["--stall-timeout", "-1"], POSITIVE_STALL),
        (&["--stall-timeout", "nan"], POSITIVE_STALL),
        (&["--stall-timeout", "inf"], POSITIVE_STALL),
        (
            &["--max-restarts", "-1"],
            "invalid value '-1' for '--max-restarts",
        ),
        (&["--master-port", "70000"], "--master-port"),
        (&["--backend", "tpu"], "--backend"),
        (
            &["--nproc-per-node", "2", "--ranks-filter", "0,5"],
            "rank 5 does not exist (the job has ranks 0-1)",
        ),
        (
            &["--ranks-filter", "0-99999999999999999"],
            "rank 99999999999999999 does not exist",
        ),
        (&["--ranks-filter", ""], "--ranks-filter"),
        (&["--ranks-filter", "0,,0"], "cannot read"),
    ];
    for (args, expect) in cases {
        refused(args, expect);
    }
}

#[test]
fn help_documents_every_flag_and_what_the_timeout_covers() {
    let r = oflaunch(&["--help"], T);
    assert_eq!(r.code(), 0, "{}", r.stderr);
    let help = r.stdout;
    for flag in argv("--nproc-per-node --nnodes --node-rank --master-addr --master-port --backend --log-dir --tee --ranks-filter --timeout --max-restarts --grace-period --token-file") {
        let documented = help
            .split(&format!("\n      {flag}"))
            .nth(1)
            .and_then(|after| after.lines().nth(1))
            .is_some_and(|l| l.trim().len() > 10);
        assert!(documented, "{flag} is not documented:\n{help}");
    }
    assert!(help.contains("every store wait and collective"), "{help}");
    assert!(
        help.contains("does not limit how long the job runs"),
        "{help}"
    );
}

#[test]
fn a_log_over_the_file_size_limit_is_reported_with_a_non_zero_exit() {
    use std::os::unix::process::CommandExt;
    let dir = scratch("fsize");
    let logs = dir.join("logs");
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args(["--nproc-per-node", "2", "--log-dir", logs.to_str().unwrap()])
        .args([WORKER, "print", "2000"]);
    // SAFETY: setrlimit is async-signal-safe; it limits only the child (oflaunch).
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 4096,
                rlim_max: 4096,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let r = start(cmd).finish(T);
    assert_eq!(r.code(), 1, "{}", r.stderr);
    says(&r, "log file(s) could not be written");
    says(&r, "rank_0.stdout");
    says(&r, "File too large");
    // The summary of the job itself was still printed.
    says(&r, "all workers finished");
}

#[test]
fn a_log_dir_on_a_full_disk_is_reported_with_a_non_zero_exit() {
    // /dev/full as a rank's log file: every write fails with ENOSPC.
    let dir = scratch("full");
    std::os::unix::fs::symlink("/dev/full", dir.join("rank_1.stdout")).unwrap();
    let r = two_printers_logged("--log-dir", &dir, T);
    assert_eq!(r.code(), 1, "{}", r.stderr);
    says(&r, "rank 1's stdout log");
    says(&r, "No space left on device");
}

#[test]
fn workers_killed_during_shared_memory_setup_leave_no_files_in_dev_shm() {
    let dir = scratch("shm_leak");
    let r = oflaunch(
        &[
            "--nproc-per-node",
            "2",
            "--backend",
            "cpu",
            WORKER,
            "shm-leak",
            dir.to_str().unwrap(),
        ],
        T,
    );
    assert_eq!(r.code(), 137, "{}", r.stderr);
    let left: Vec<String> = (0..2)
        .filter_map(|rank| std::fs::read_to_string(dir.join(format!("rank_{rank}.shm"))).ok())
        .collect();
    assert!(!left.is_empty(), "no worker got as far: {}", r.stderr);
    for path in left {
        assert!(path.starts_with("/dev/shm/oxiflow-"), "{path}");
        assert!(
            !std::path::Path::new(&path).exists(),
            "{path} was left behind"
        );
    }
}
