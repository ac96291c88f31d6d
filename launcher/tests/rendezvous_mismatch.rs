//! Workers whose launch environment disagrees with the job's (a different WORLD_SIZE, a rank
//! not below the world size, a duplicate RANK, a wrong token) are refused at the rendezvous
//! within seconds, every rank's error and oflaunch's summary naming the rank and the mismatch.
//! The bad environment is set by a wrapper script around real worker processes, or the
//! workers are started by hand.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// Each refusal must end the job this fast (the timeout given to the ranks is 60 s).
const DETECT_LIMIT: Duration = Duration::from_secs(10);
const T: Duration = Duration::from_secs(60);

/// Runs a 2-rank job of `allreduce` workers under `sh -c SCRIPT`, the script changing the
/// environment of some ranks before it runs the worker (`$0`).
fn job_with_wrapper(script: &str) -> (Finished, Duration) {
    let t0 = Instant::now();
    let r = oflaunch(
        &[
            "--nproc-per-node",
            "2",
            "--backend",
            "cpu",
            "--timeout",
            "60",
            "sh",
            "-c",
            script,
            WORKER,
        ],
        T,
    );
    let took = t0.elapsed();
    eprintln!("{}\n(ended after {took:?})", r.stderr);
    (r, took)
}

fn assert_refused(r: &Finished, took: Duration, what: &str) {
    assert!(took <= DETECT_LIMIT, "took {took:?}");
    assert_ne!(r.code(), 0, "the job reported success\n{}", r.stderr);
    says(r, "first failure: rank ");
    assert!(r.stderr.contains(what), "no {what:?} in\n{}", r.stderr);
}

#[test]
fn a_world_size_mismatch_is_refused_at_rendezvous() {
    let (r, took) = job_with_wrapper(
        r#"if [ "$RANK" = 1 ]; then export WORLD_SIZE=3; fi; exec "$0" allreduce 1"#,
    );
    assert_refused(
        &r,
        took,
        "has WORLD_SIZE=3, but the job's world size is 2 (set by oflaunch on node 0)",
    );
}

#[test]
fn a_rank_beyond_the_world_is_refused_at_rendezvous() {
    let (r, took) = job_with_wrapper(
        r#"if [ "$RANK" = 1 ]; then export RANK=3 WORLD_SIZE=4; fi; exec "$0" allreduce 1"#,
    );
    assert_refused(&r, took, "rank 3 (pid ");
    says(&r, "is not below the job's world size 2");
}

#[test]
fn a_duplicate_rank_is_refused_at_rendezvous() {
    let (r, took) = job_with_wrapper(r#"export RANK=0; exec "$0" allreduce 1"#);
    assert_refused(&r, took, "rank 0 is claimed twice: by pid ");
    says(&r, "(duplicate RANK)");
}

#[test]
fn a_wrong_token_is_named_with_its_rank() {
    let (r, took) = job_with_wrapper(
        r#"if [ "$RANK" = 1 ]; then export OXIFLOW_TOKEN=0123456789abcdef; fi; exec "$0" allreduce 1"#,
    );
    assert_refused(&r, took, "first failure: rank 1 ");
    assert!(
        r.stderr.contains("rank 1 of 2: the store at 127.0.0.1:")
            && r.stderr.contains("refused this rank's OXIFLOW_TOKEN"),
        "{}",
        r.stderr
    );
}

/// Three workers started by hand for a world of 3, two of them as rank 1: every one of them
/// fails within seconds naming the duplicate (nobody waits for the missing rank 2).
#[test]
fn hand_started_workers_with_a_duplicate_rank_all_fail_fast() {
    let port = free_port().to_string();
    let token = "00112233445566778899aabbccddeeff";
    let t0 = Instant::now();
    let workers: Vec<Running> = [0, 1, 1]
        .iter()
        .map(|rank| {
            let mut cmd = Command::new(WORKER);
            cmd.args(["allreduce", "1"])
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("WORLD_SIZE", "3")
                .env("RANK", rank.to_string())
                .env("OXIFLOW_TOKEN", token)
                .env("OXIFLOW_BACKEND", "cpu")
                .env("OXIFLOW_TIMEOUT", "60");
            start(cmd)
        })
        .collect();
    for w in workers {
        let r = w.finish(T);
        let took = t0.elapsed();
        eprintln!("{}", r.stderr);
        assert!(took <= DETECT_LIMIT, "took {took:?}");
        assert_ne!(r.code(), 0, "{}", r.stderr);
        says(&r, "rank 1 is claimed twice");
    }
}
