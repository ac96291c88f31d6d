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
    assert!(r.stderr.contains("--token-file"), "{}", r.stderr);
    assert!(r.stderr.contains("/proc/PID/cmdline"), "{}", r.stderr);
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
