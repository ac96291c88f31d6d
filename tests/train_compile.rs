//! `train --compile` under `oflaunch` with real processes (CPU backend): each step's forward
//! and backward passes captured on the first step and replayed after give the eager loss
//! curve (f64: 1e-9 relative; bf16-mixed: bit for bit) on 1 rank, DP4, TP4, DP2 x TP2 with sequence parallelism and
//! gradient buckets, DP2 with ZeRO-3, full recomputation and gradient accumulation, PP2 x DP2
//! pipelines (interleaved with ZeRO-2 and buckets; 1F1B with gradient accumulation), and for
//! the MLP classifier; rank 0 prints one `compiled:` line and, with `--explain`, the program
//! with its collectives; dropout is refused, pipelined or not.

mod common;

use common::{argv, curve, launch, max_rel, ok};

const STEPS: &str = "5";

fn compare(nproc: usize, args: &[&str]) {
    compare_at(nproc, &["--dtype", "f64"], args, 1e-9);
}

/// `compare` in the precision `precision` names, to a largest relative difference `tol`.
fn compare_at(nproc: usize, precision: &[&str], args: &[&str], tol: f64) {
    let mut base = vec!["--steps", STEPS, "--log-every", "1"];
    base.extend_from_slice(precision);
    base.extend_from_slice(args);
    let eager_text = ok(launch(nproc, &base));
    base.push("--compile");
    let compiled_text = ok(launch(nproc, &base));
    let (eager, compiled) = (curve(&eager_text), curve(&compiled_text));
    assert_eq!(eager.len(), 5, "{eager_text}");
    assert_eq!(compiled.len(), 5, "{compiled_text}");
    let diff = max_rel(&eager, &compiled);
    assert!(
        diff <= tol,
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

/// Under bf16-mixed the program reads each leaf's bf16 compute copy as an input, as eager
/// reads it (the optimizer writes it with the leaf): bit for bit on one rank and under ZeRO-3,
/// whose sharded leaves gather their copies; under ZeRO-1 and ZeRO-2, whose leaves are
/// all-gathered anew after each step, the program casts each leaf where it is first read, as
/// eager does.
#[test]
fn compiled_bf16_mixed_steps_equal_eager_bit_for_bit() {
    let bf16 = ["--precision", "bf16-mixed"];
    compare_at(1, &bf16, &[], 0.0);
    compare_at(2, &bf16, &["--dp", "2", "--zero", "3"], 0.0);
    compare_at(2, &bf16, &["--dp", "2", "--zero", "2"], 0.0);
    compare_at(
        2,
        &bf16,
        &["--dp", "2", "--zero", "1", "--bucket-mb", "0.05"],
        0.0,
    );
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
    compare(2, &argv("--dp 2 --zero 3 --recompute full --grad-accum 2"));
}

#[test]
fn compiled_mlp_steps_equal_eager() {
    compare(2, &["--model", "mlp", "--dp", "2"]);
}

/// A GPT of 4 blocks (2 stages x 2 virtual stages), width 32, 16-token windows, 8 rows.
const PIPELINED: [&str; 8] = [
    "--layers",
    "4",
    "--width",
    "32",
    "--seq-len",
    "16",
    "--batch-size",
    "8",
];

#[test]
fn compiled_gpt_pipelines_equal_eager_pp2_dp2() {
    let mut interleaved = PIPELINED.to_vec();
    interleaved.extend_from_slice(&argv(
        "--pp 2 --dp 2 --micro-batches 4 --schedule interleaved \
        --virtual-stages 2 --zero 2 --bucket-mb 0.01",
    ));
    compare(4, &interleaved);
    let mut one_f_one_b = PIPELINED.to_vec();
    one_f_one_b.extend_from_slice(&argv(
        "--pp 2 --dp 2 --micro-batches 2 --schedule 1f1b --grad-accum 2",
    ));
    compare(4, &one_f_one_b);
}

/// `--compile --explain` prints the compiled program: ops against kernels, the arena, and each
/// gradient bucket's all-reduce with the kernels queued before its result is read (what it
/// overlaps on devices).
#[test]
fn explain_prints_the_compiled_program_and_its_collectives() {
    let text = ok(launch(
        2,
        &["--compile", "--explain", "--dp", "2", "--bucket-mb", "0.05"],
    ));
    assert!(text.contains("[rank 0] compiled program: "), "{text}");
    assert!(text.contains(" kernels and "), "{text}");
    let overlapped = text
        .lines()
        .filter(|l| l.starts_with("[rank 0]") && l.contains(": P -> B, "))
        .filter_map(|l| {
            l.split("; ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .collect::<Vec<_>>();
    // The last bucket fills as the backward pass ends: only the optimizer, which reads it, is
    // left to run (its result is cut into views, which run no kernel).
    let (_, before) = overlapped.split_last().expect("buckets");
    assert!(
        before.len() >= 2 && before.iter().all(|&k| k > 0),
        "every bucket's all-reduce but the last has kernels queued under it: {overlapped:?}\n{text}"
    );
}

#[test]
fn compile_is_refused_with_dropout_pipelined_or_not() {
    for (n, pp) in [(1, "1"), (2, "2")] {
        let out = launch(
            n,
            &["--steps", "2", "--pp", pp, "--dropout", "0.1", "--compile"],
        );
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        // Refused while the configuration resolves, alike on every rank: one line, after the
        // rank or the ranks that printed it (the launcher may stop the others first).
        assert!(
            err.lines()
                .any(|l| l.starts_with("[rank")
                    && l.contains("] train: --compile with --dropout 0.1")),
            "{err}"
        );
    }
}
