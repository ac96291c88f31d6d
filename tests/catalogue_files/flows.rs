//! Flows over several runs: a run continues its own metrics and plot, refuses another run's and
//! replaces them only with `--overwrite`; a live job's save path is refused at once.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::inputs::Inputs;
use super::{changes, snapshot};
use crate::common::argv;
use crate::{not_refused, run_limited, Ended, CASE_LIMIT};

/// What `train ARGS` in `dir` printed and exited with.
fn train_in(train: &Path, dir: &Path, args: &[&str]) -> Ended {
    let mut cmd = Command::new(train);
    cmd.args(args).current_dir(dir);
    run_limited(cmd, CASE_LIMIT * 6)
}

/// The run ids of the run records of the metrics file at `path`, with their first steps.
fn runs_of(path: &Path) -> Vec<(String, u64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["kind"] == "run")
        .map(|r| {
            (
                r["run_id"].as_str().unwrap().to_string(),
                r["from_step"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// A run continues its own metrics and plot when it resumes, refuses another run's, and
/// replaces them only with `--overwrite`; the save path of a live job is refused at once.
pub fn own_outputs_and_live_saves(train: &Path) {
    let inputs = Inputs::new("flows", train);
    let d = &inputs.0;
    let first =
        argv("--model mlp --steps 6 --log-every 2 --save run --metrics m.jsonl --plot p.png");
    let e = train_in(train, d, &first);
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let runs = runs_of(&d.join("m.jsonl"));
    assert_eq!(runs.len(), 1, "{runs:?}");
    let plot = std::fs::read(d.join("p.png")).unwrap();
    // The same command again is another run: refused, nothing changed.
    let before = snapshot(d);
    let e = train_in(train, d, &first);
    assert!(
        not_refused(&e, &format!("holds the records of run {}", runs[0].0)).is_none(),
        "{}",
        e.stderr
    );
    assert!(changes(&before, &snapshot(d)).is_empty());
    // Resuming the run continues both.
    let mut resumed = first.to_vec();
    resumed.extend(["--resume", "run"]);
    resumed[3] = "10";
    let e = train_in(train, d, &resumed);
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let again = runs_of(&d.join("m.jsonl"));
    assert_eq!(again, [runs[0].clone(), (runs[0].0.clone(), 6)]);
    assert_ne!(
        std::fs::read(d.join("p.png")).unwrap(),
        plot,
        "the plot is redrawn"
    );
    // --overwrite replaces them with a new run's.
    let mut fresh = first.to_vec();
    fresh[7] = "run2";
    fresh.push("--overwrite");
    let e = train_in(train, d, &fresh);
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let replaced = runs_of(&d.join("m.jsonl"));
    assert!(
        replaced.len() == 1 && replaced[0].0 != runs[0].0,
        "{replaced:?}"
    );
    // A live job holds its save path: a second job is refused at once, naming its pid.
    let mut long = Command::new(train);
    long.args(argv(
        "--model mlp --steps 100000000 --log-every 100000000 --save held",
    ))
    .current_dir(d)
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    let mut holder = long.spawn().unwrap();
    let lock = d.join("held.job.lock");
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(&lock).is_ok_and(|s| s.contains("pid")) {
        assert!(start.elapsed() < CASE_LIMIT, "the job never took its lock");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let before = snapshot(d);
    let e = train_in(
        train,
        d,
        &["--model", "mlp", "--steps", "3", "--save", "./held"],
    );
    let _ = holder.kill();
    let _ = holder.wait();
    let want = format!("held by a live job (pid {} on host", holder.id());
    assert!(not_refused(&e, &want).is_none(), "{}", e.stderr);
    assert!(
        e.took < CASE_LIMIT,
        "refused at once, not after {:?}",
        e.took
    );
    assert!(changes(&before, &snapshot(d)).is_empty());
}
