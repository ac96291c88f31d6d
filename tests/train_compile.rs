//! `train --compile` under `oflaunch` with real processes (CPU backend): each step's forward
//! and backward passes captured on the first step and replayed after give the eager loss
//! curve (f64: 1e-9 relative) on 1 rank, DP4, TP4, DP2 x TP2 with sequence parallelism and
//! gradient buckets, DP2 with ZeRO-3, full recomputation and gradient accumulation, and for the
//! MLP classifier; rank 0 prints one `compiled:` line; combinations it cannot run are refused.

mod common;

use common::{curve, launch, max_rel, ok};

const STEPS: &str = "5";

fn compare(nproc: usize, args: &[&str]) {
    let mut base = vec!["--steps", STEPS, "--log-every", "1", "--dtype", "f64"];
    base.extend_from_slice(args);
    let eager_text = ok(launch(nproc, &base));
    base.push("--compile");
    let compiled_text = ok(launch(nproc, &base));
    let (eager, compiled) = (curve(&eager_text), curve(&compiled_text));
    assert_eq!(eager.len(), 5, "{eager_text}");
    assert_eq!(compiled.len(), 5, "{compiled_text}");
    let diff = max_rel(&eager, &compiled);
    assert!(
        diff <= 1e-9,
        "{args:?}: compiled differs from eager by {diff:e}"
    );
    let lines: Vec<&str> = compiled_text
        .lines()
        .filter(|l| l.contains("compiled: "))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "one compile line, from rank 0: {compiled_text}"
    );
    let line = lines[0];
    assert!(
        line.starts_with("[rank 0] compiled: ")
            && line.contains(" ops -> ")
            && line.contains(" kernels, arena ")
            && line.contains("(eager peak ")
            && line.contains("compile time "),
        "{line}"
    );
    assert!(!eager_text.contains("compiled: "));
}

#[test]
fn compiled_gpt_steps_equal_eager_on_one_rank() {
    compare(1, &[]);
}

#[test]
fn compiled_gpt_steps_equal_eager_dp4_and_tp4() {
    compare(4, &["--dp", "4"]);
    compare(4, &["--tp", "4"]);
}

#[test]
fn compiled_gpt_steps_equal_eager_dp2_tp2_sp_with_buckets() {
    compare(
        4,
        &["--dp", "2", "--tp", "2", "--sp", "--bucket-mb", "0.01"],
    );
}

#[test]
fn compiled_gpt_steps_equal_eager_zero3_recompute_grad_accum() {
    compare(
        2,
        &[
            "--dp",
            "2",
            "--zero",
            "3",
            "--recompute",
            "full",
            "--grad-accum",
            "2",
        ],
    );
}

#[test]
fn compiled_mlp_steps_equal_eager() {
    compare(2, &["--model", "mlp", "--dp", "2"]);
}

#[test]
fn compile_is_refused_with_pipelines_and_dropout() {
    let out = launch(2, &["--steps", "2", "--pp", "2", "--compile"]);
    assert!(!out.status.success());
    let err =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(err.contains("--compile runs unpipelined steps"), "{err}");
    let out = launch(1, &["--steps", "2", "--dropout", "0.1", "--compile"]);
    assert!(!out.status.success());
    let err =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(err.contains("--compile with --dropout 0.1"), "{err}");
}
