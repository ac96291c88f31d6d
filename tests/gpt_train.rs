//! `train --model gpt` under `oflaunch` with real processes (CPU/TCP backend): the loss curve
//! of a tiny GPT over 50 steps is the same on 1 rank and under DP=4, TP=4, DP=2 x TP=2 and
//! TP=2 with sequence parallelism (f64 and f32; with dropout too); a checkpoint saved under
//! DP=4 resumes under DP=2 x TP=2 (and the reverse) with the uninterrupted run's next losses;
//! a checkpoint alone generates text; bad layouts are refused on every rank before training.

mod common;

use common::{argv, assert_close, curve, launch, max_rel, ok, TINY_GPT as TINY};

/// `launch` of the tiny GPT with `args` added.
fn tiny(nproc: usize, args: &[&str]) -> Vec<(u64, f64)> {
    let mut all = TINY.to_vec();
    all.extend_from_slice(args);
    curve(&ok(launch(nproc, &all)))
}

/// The layouts compared with one rank: (processes, flags).
const LAYOUTS: [(usize, &[&str]); 4] = [
    (4, &["--dp", "4"]),
    (4, &["--tp", "4"]),
    (4, &["--dp", "2", "--tp", "2"]),
    (2, &["--dp", "1", "--tp", "2", "--sp"]),
];

fn layouts_agree(dtype: &str, tolerance: f64) {
    let common = ["--steps", "50", "--seed", "7", "--dtype", dtype];
    let one = tiny(1, &common);
    assert_eq!(one.len(), 50);
    assert!(
        one[49].1 < one[0].1 - 1.0,
        "{dtype}: training makes progress: {one:?}"
    );
    for (n, layout) in LAYOUTS {
        let mut args = common.to_vec();
        args.extend_from_slice(layout);
        let c = tiny(n, &args);
        assert_close(format_args!("{dtype} {layout:?}"), &one, &c, tolerance);
    }
}

#[test]
fn gpt_loss_curves_are_equal_across_layouts_in_f64() {
    layouts_agree("f64", 1e-5);
}

#[test]
fn dropout_masks_are_the_same_for_every_layout() {
    let common = argv("--steps 20 --seed 5 --dtype f64 --dropout 0.2");
    let one = tiny(1, &common);
    let mut args = common.to_vec();
    args.extend_from_slice(&["--dp", "2", "--tp", "2", "--sp"]);
    let four = tiny(4, &args);
    assert_close("dropout", &one, &four, 1e-5);
    let mut plain = common.to_vec();
    plain.truncate(6);
    assert_ne!(tiny(1, &plain), one, "dropout changes the curve");
}

#[test]
fn gpt_loss_curves_are_equal_across_layouts_in_f32() {
    layouts_agree("f32", 1e-4);
}

/// Bytes `train` reports for rank 0: (parameters, gradients, optimizer state, step peak).
fn memory_line(out: &str) -> (u64, u64, u64, u64) {
    let line = out
        .lines()
        .find(|l| l.contains("memory rank 0"))
        .unwrap_or_else(|| panic!("no memory line in {out}"));
    let num = |key: &str| -> u64 {
        let at = line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len();
        line[at..]
            .split_whitespace()
            .next()
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("{key} value in {line}"))
    };
    (
        num("parameters "),
        num("gradients "),
        num("optimizer-state "),
        num("step peak host "),
    )
}

/// ZeRO 1-3 and recomputation (full, selective, GELU) under DP4 and DP2xTP2 give the one-rank
/// curve; each ZeRO stage shards what it promises, and recomputation lowers the step's peak.
#[test]
fn zero_stages_and_recompute_keep_the_curve_and_shrink_memory() {
    let common = ["--steps", "12", "--seed", "3", "--dtype", "f64"];
    let one = tiny(1, &common);
    let mut mem = Vec::new();
    for (n, extra) in [
        (4, &["--dp", "4", "--zero", "0"][..]),
        (4, &["--dp", "4", "--zero", "1"][..]),
        (4, &["--dp", "4", "--zero", "2"][..]),
        (4, &["--dp", "4", "--zero", "3"][..]),
        (4, &["--dp", "4", "--zero", "3", "--recompute", "full"][..]),
        (4, &argv("--dp 2 --tp 2 --zero 2 --recompute selective")[..]),
        (4, &["--dp", "4", "--zero", "0", "--recompute", "gelu"][..]),
    ] {
        let mut args = TINY.to_vec();
        args.extend_from_slice(&common);
        args.extend_from_slice(extra);
        let out = ok(launch(n, &args));
        assert_close(format_args!("{extra:?}"), &one, &curve(&out), 1e-9);
        mem.push(memory_line(&out));
    }
    let (p0, g0, s0, peak0) = mem[0];
    assert_eq!(
        (mem[1].0, mem[1].1),
        (p0, g0),
        "ZeRO-1 keeps parameters and gradients"
    );
    assert!(
        mem[1].2 <= s0 / 4 + 4096,
        "ZeRO-1 shards the state: {mem:?}"
    );
    assert!(
        mem[2].1 <= g0 / 4 + 2048,
        "ZeRO-2 shards gradients: {mem:?}"
    );
    assert!(
        mem[3].0 <= p0 / 4 + 2048,
        "ZeRO-3 shards parameters: {mem:?}"
    );
    assert!(mem[4].3 < mem[3].3, "recompute lowers the peak: {mem:?}");
    assert!(peak0 > 0);
}

/// Where activations make the peak (64 windows of 64 tokens on one rank), recomputing the
/// MLP's GELU output lowers it by about one `[rows, 4C]` tensor a block, with the same curve.
#[test]
fn gelu_recomputation_lowers_an_activation_bound_peak() {
    let run = |recompute: &str| {
        let mut args = TINY[..6].to_vec();
        args.extend_from_slice(&[
            "--seq-len",
            "64",
            "--batch-size",
            "64",
            "--gen-tokens",
            "0",
            "--log-every",
            "1",
            "--steps",
            "3",
            "--seed",
            "5",
            "--dtype",
            "f64",
            "--recompute",
            recompute,
        ]);
        let out = ok(launch(1, &args));
        (curve(&out), memory_line(&out).3)
    };
    let ((kept_curve, kept_peak), (gelu_curve, gelu_peak)) = (run("none"), run("gelu"));
    let diff = max_rel(&kept_curve, &gelu_curve);
    assert!(diff <= 1e-12, "the curves differ by {diff:e}");
    // 2 blocks of 4096 rows x 128 f64: 8 MiB kept less at the peak, less what the recomputed
    // tensor costs while it lives.
    assert!(
        gelu_peak + (2 << 20) < kept_peak,
        "GELU recomputation: peak {gelu_peak} against {kept_peak}"
    );
}

/// The resume test's flags with `extra` added.
fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["--seed", "9", "--dtype", "f64"];
    a.extend_from_slice(extra);
    a
}

#[test]
fn a_gpt_checkpoint_resumes_under_another_layout_and_generates_alone() {
    let dp4: &[&str] = &["--dp", "4"];
    let dp2tp2: &[&str] = &["--dp", "2", "--tp", "2"];
    let full = tiny(4, &with(&[&["--steps", "30"], dp4].concat()));
    assert_eq!(full.len(), 30);
    for (name, save_at, resume_at) in [
        ("dp4-to-dp2tp2", dp4, dp2tp2),
        ("dp2tp2-to-dp4", dp2tp2, dp4),
    ] {
        let dir = common::scratch_dir("gpt", name);
        let p = dir.join("ckpt");
        let ps = p.to_str().unwrap();
        let first = tiny(
            4,
            &with(&[&["--steps", "20", "--save", ps], save_at].concat()),
        );
        assert_eq!(first.len(), 20);
        let resumed = tiny(
            4,
            &with(&[&["--steps", "30", "--resume", ps], resume_at].concat()),
        );
        let diff = max_rel(&full[20..], &resumed);
        eprintln!(
            "{name}: resumed at step {}, max relative difference {diff:.3e}",
            resumed[0].0
        );
        assert!(diff <= 1e-5, "{name}: resumed curve differs by {diff:e}");

        // The model's sizes only: a run that only generates refuses training flags.
        let mut gen = TINY[..8].to_vec();
        gen.extend(with(&[
            "--resume",
            ps,
            "--generate",
            "The ",
            "--gen-tokens",
            "8",
            "--tp",
            "2",
        ]));
        let text = ok(launch(2, &gen));
        assert!(text.contains("sample (temperature"), "{text}");
        assert!(
            curve(&text).is_empty(),
            "generating alone trains no step: {text}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn bad_gpt_layouts_are_refused_on_every_rank() {
    let cases: [(&[&str], &str); 3] = [
        (
            &["--tp", "4", "--heads", "2", "--width", "32"],
            "--heads 2 is not a multiple of --tp 4",
        ),
        (
            &["--dp", "4", "--batch-size", "6"],
            "--batch-size 6 must be a multiple of --dp 4",
        ),
        (&["--dp", "4", "--optimizer", "sgd"], "trains with AdamW"),
    ];
    for (args, want) in cases {
        let out = launch(4, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
