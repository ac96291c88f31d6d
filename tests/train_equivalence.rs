//! The `train` example's MLP classifier (`--model mlp`) under `oflaunch` with real processes (CPU/TCP backend): loss curves equal
//! across layouts (1 rank, DP=4, TP=4, DP=2 x TP=2), the default run reaches the documented
//! threshold, and a save interrupted by a crash (a rank of this test binary with the trainer
//! library's save hook, under oflaunch) leaves a checkpoint that resumes under another layout
//! with the same curve as an uninterrupted run.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use clap::Parser;
use common::{argv, curve, final_line, launch_mlp as launch, max_rel, ok};
use oxiflow::checkpoint::SaveStage;
use oxiflow::trainer::{main_with, Cli, JobHooks, StepHook, StepStats, TrainError};

/// The loss threshold the README documents for the default command.
const THRESHOLD: f64 = 0.1;

#[test]
fn loss_curves_are_equal_across_layouts_with_real_processes() {
    let common = ["--steps", "50", "--log-every", "1", "--seed", "3"];
    let one = curve(&ok(launch(1, &common)));
    assert_eq!(one.len(), 50);
    assert!(
        one[49].1 < 0.5 * one[0].1,
        "training makes progress: {one:?}"
    );
    for (dp, tp) in [(4, 1), (1, 4), (2, 2)] {
        let (d, t) = (dp.to_string(), tp.to_string());
        let mut args = vec!["--dp", &d, "--tp", &t];
        args.extend(common);
        let c = curve(&ok(launch(4, &args)));
        let diff = max_rel(&one, &c);
        eprintln!(
            "dp {dp} tp {tp}: loss {:.6} -> {:.6}, max relative difference {diff:.3e}",
            c[0].1, c[49].1
        );
        assert!(diff < 1e-5, "dp {dp} tp {tp} differs by {diff:e}");
    }
}

#[test]
fn the_default_run_reaches_the_documented_threshold() {
    let text = ok(launch(4, &[]));
    let (loss, sps) = final_line(&text);
    eprintln!("default run (4 ranks, DP=4): final loss {loss} steps/s {sps}");
    assert!(loss < THRESHOLD, "final loss {loss} >= {THRESHOLD}\n{text}");
}

/// The stage a `crash_rank` aborts at (1 mid-file, 2 before publish, 3 between renames) and
/// the step it has reached.
static CRASH_AT: AtomicUsize = AtomicUsize::new(0);
static STEP: AtomicU64 = AtomicU64::new(0);

/// Aborts (like a kill) at the chosen stage of the saves after step 10.
fn crash_hook(stage: SaveStage) {
    let code = usize::from(common::save_stage_code(stage));
    if STEP.load(Ordering::SeqCst) > 10 && CRASH_AT.load(Ordering::SeqCst) == code {
        std::process::abort();
    }
}

struct StepCounter;
impl StepHook for StepCounter {
    fn after_step(&mut self, s: &StepStats) -> Result<(), TrainError> {
        STEP.store(s.step, Ordering::SeqCst);
        Ok(())
    }
}

/// A rank of `a_crashed_save_leaves_a_checkpoint_that_resumes_under_another_layout`, started
/// by oflaunch running this test binary: the trainer library with the crash hook above at the
/// stage `OXIFLOW_TEST_CRASH_STAGE` names, on the flags of `OXIFLOW_TEST_TRAIN_ARGS`.
#[test]
#[ignore = "a rank of the crash test, started by oflaunch"]
fn crash_rank() {
    let stage = std::env::var("OXIFLOW_TEST_CRASH_STAGE").expect("started by the crash test");
    let args = std::env::var("OXIFLOW_TEST_TRAIN_ARGS").expect("started by the crash test");
    let code = ["mid-file", "before-publish", "between-renames"]
        .iter()
        .position(|s| *s == stage)
        .expect("a known stage")
        + 1;
    CRASH_AT.store(code, Ordering::SeqCst);
    let cli = Cli::parse_from(std::iter::once("train").chain(args.split_whitespace()));
    let hooks = JobHooks {
        save_stage: Some(crash_hook),
        step_hooks: vec![Box::new(StepCounter)],
    };
    main_with(cli, hooks).expect("the job runs until the crash");
}

#[test]
fn a_crashed_save_leaves_a_checkpoint_that_resumes_under_another_layout() {
    let full = curve(&ok(launch(
        4,
        &["--steps", "30", "--log-every", "1", "--seed", "5"],
    )));
    let (oflaunch, _) = common::binaries();
    let me = std::env::current_exe().expect("the test binary");
    for stage in ["mid-file", "before-publish", "between-renames"] {
        let dir =
            std::env::temp_dir().join(format!("oxiflow-train-ckpt-{}-{stage}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let p = dir.join("ckpt");
        let ps = p.to_str().unwrap();
        // DP=2 x TP=2 saves at step 10, then aborts inside the save at step 20.
        let crashed = Command::new(oflaunch)
            .args(["--nproc-per-node", "4", "--backend", "cpu"])
            .arg(&me)
            .args(argv(
                "--exact crash_rank --ignored --nocapture --test-threads 1",
            ))
            .env("OXIFLOW_TEST_CRASH_STAGE", stage)
            .env(
                "OXIFLOW_TEST_TRAIN_ARGS",
                format!(
                    "--model mlp --dp 2 --tp 2 --steps 30 --seed 5 --save {ps} --save-every 10"
                ),
            )
            .output()
            .expect("run oflaunch");
        assert!(
            !crashed.status.success(),
            "{stage}: the job was meant to crash"
        );
        // Resume under TP=2 (2 processes): continues from step 10 exactly like the full run.
        let resumed = curve(&ok(launch(
            2,
            &[
                "--dp",
                "1",
                "--tp",
                "2",
                "--steps",
                "30",
                "--log-every",
                "1",
                "--seed",
                "5",
                "--resume",
                ps,
            ],
        )));
        assert_eq!(
            resumed.first().map(|c| c.0),
            Some(11),
            "{stage}: {resumed:?}"
        );
        let diff = max_rel(&full[10..], &resumed);
        eprintln!(
            "{stage}: resumed at step {} under TP=2, max relative difference {diff:.3e}",
            resumed[0].0
        );
        assert!(diff < 1e-5, "{stage}: resumed curve differs by {diff:e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
