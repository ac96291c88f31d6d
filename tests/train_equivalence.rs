//! The `train` example's MLP classifier (`--model mlp`) under `oflaunch` with real processes (CPU/TCP backend): loss curves equal
//! across layouts (1 rank, DP=4, TP=4, DP=2 x TP=2), the default run reaches the documented
//! threshold, and a save interrupted by a crash leaves a checkpoint that resumes under another
//! layout with the same curve as an uninterrupted run.

mod common;

use common::{curve, final_line, launch_mlp as launch, max_rel, ok};

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

#[test]
fn a_crashed_save_leaves_a_checkpoint_that_resumes_under_another_layout() {
    let full = curve(&ok(launch(
        4,
        &["--steps", "30", "--log-every", "1", "--seed", "5"],
    )));
    for stage in ["mid-file", "before-publish", "between-renames"] {
        let dir =
            std::env::temp_dir().join(format!("oxiflow-train-ckpt-{}-{stage}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let p = dir.join("ckpt");
        let ps = p.to_str().unwrap();
        // DP=2 x TP=2 saves at step 10, then aborts inside the save at step 20.
        let crashed = launch(
            4,
            &[
                "--dp",
                "2",
                "--tp",
                "2",
                "--steps",
                "30",
                "--seed",
                "5",
                "--save",
                ps,
                "--save-every",
                "10",
                "--crash-during-save",
                stage,
            ],
        );
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
        let diff = max_rel(&full[10..], &resumed);
        eprintln!(
            "{stage}: resumed at step {} under TP=2, max relative difference {diff:.3e}",
            resumed[0].0
        );
        assert!(diff < 1e-5, "{stage}: resumed curve differs by {diff:e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
