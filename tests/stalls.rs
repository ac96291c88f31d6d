//! Stalls acted on, with real `train` jobs under `oflaunch` at its default settings: a rank
//! whose main thread is frozen under ptrace (as a debugger leaves it; its heartbeat thread
//! runs on) and a frozen pipeline stage each end the job well within 10 s of the freeze, as
//! oflaunch measures it, naming the frozen rank and not its waiting neighbours; nothing is
//! left running.

mod common;

use std::time::{Duration, Instant};

use common::{alive, argv, finish_job, ptrace_freeze, start_job, wait_line, workers_of, TINY_GPT};

/// The longest oflaunch may take, by its own measure, from a rank's last progress to stopping
/// the workers: the 10 s bound and a small margin for a loaded machine.
const BOUND: f64 = 10.5;
/// Wall-clock limit of a whole job (generous: a bound on hangs, not the measure).
const T: Duration = Duration::from_secs(90);

/// oflaunch's own measure: "the workers were stopped X s after rank R last showed progress".
fn measured(stderr: &str, rank: usize) -> f64 {
    let line = stderr
        .lines()
        .find(|l| l.contains(&format!("s after rank {rank} last showed progress")))
        .unwrap_or_else(|| panic!("no measured end for rank {rank}:\n{stderr}"));
    line.split("stopped ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("unreadable: {line}"))
}

/// Freezes `victim` under ptrace once the job has trained a while; checks the job ends
/// naming it, within the bound, with nothing left running. Returns oflaunch's stderr.
fn freeze_and_check(nproc: usize, args: &[&str], ready: &str, victim: usize) -> String {
    let job = start_job(nproc, args);
    let workers = workers_of(job.child.id(), nproc);
    wait_line(&job, ready, T);
    let pid = workers[victim].1;
    let frozen_at = Instant::now();
    let (tracer, tracer_tid) = ptrace_freeze(pid);
    let (took, code, stderr) = finish_job(job, frozen_at, T);
    let took = took.as_secs_f64();
    tracer.join().unwrap();
    let by_oflaunch = measured(&stderr, victim);
    eprintln!(
        "{args:?}: rank {victim} frozen; oflaunch stopped the workers {by_oflaunch:.1} s after \
         its last progress, exited {took:.1} s after the freeze"
    );
    assert_eq!(code, 124, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "rank {victim} is frozen: its main thread is in a ptrace stop (traced by pid \
             {tracer_tid})"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("first failure: rank {victim} (node 0")),
        "{stderr}"
    );
    assert!(by_oflaunch <= BOUND, "{by_oflaunch} s\n{stderr}");
    for (rank, pid) in &workers {
        assert!(!alive(*pid), "rank {rank} (pid {pid}) left running");
    }
    stderr
}

#[test]
fn a_rank_frozen_under_ptrace_ends_the_job_naming_it() {
    freeze_and_check(
        3,
        &argv("--model mlp --steps 100000000 --log-every 100"),
        "step 200 loss",
        1,
    );
}

/// A 4-rank pipeline (2 stages x DP 2): stage 1's rank 3 freezes; rank 1 waits for it in the
/// stage's all-reduce and rank 2 (stage 0) waits to receive its gradient, so ranks that wait
/// may be named behind, but only as waiting themselves; the failure is rank 3's.
#[test]
fn a_frozen_pipeline_stage_is_blamed_not_its_neighbours() {
    let mut args = vec!["--model", "gpt"];
    args.extend(TINY_GPT);
    args.extend(argv("--pp 2 --dp 2 --micro-batches 2 --steps 100000000"));
    let stderr = freeze_and_check(4, &args, "step 10 loss", 3);
    for line in stderr.lines().filter(|l| l.contains(" is behind: ")) {
        let line = line.trim_start().trim_start_matches("oflaunch: ");
        assert!(
            line.starts_with("rank 3 is behind")
                || line.ends_with("it waits itself for another rank named here"),
            "a waiting neighbour blamed: {line}\n{stderr}"
        );
    }
    assert!(!stderr.contains("first failure: rank 0"), "{stderr}");
}
