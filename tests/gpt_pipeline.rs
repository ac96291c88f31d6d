//! Pipeline parallelism under `oflaunch` with real processes (CPU/TCP backend): `train` with
//! `--pp` and micro-batches gives one rank's full-batch loss curve for GPipe, 1F1B and
//! interleaved 1F1B, PP2, PP4, PP2xDP2, PP2xTP2 and PP2xDP2xTP2 (8 processes), with ZeRO 1-3
//! and recomputation in some combinations (f64 to 1e-12, f32 to 1e-4); dropout masks and
//! greedy generation through the stages match one rank's; a checkpoint saved
//! under a pipeline with ZeRO resumes under DP/TP and the reverse; invalid pipelines are
//! refused on every rank before training.

mod common;

use common::{argv, assert_close, curve, launch, max_rel, ok};

/// A tiny model: 4 blocks, width 32, 4 heads, 16-token windows, 8 per batch.
const TINY: [&str; 14] = common::gpt_flags("4", "32", "16");

fn tiny_out(nproc: usize, args: &[&str]) -> String {
    let mut all = TINY.to_vec();
    all.extend_from_slice(args);
    ok(launch(nproc, &all))
}

fn tiny(nproc: usize, args: &[&str]) -> Vec<(u64, f64)> {
    curve(&tiny_out(nproc, args))
}

fn agree(dtype: &str, tolerance: f64, layouts: &[(usize, &[&str])]) {
    let common = ["--steps", "8", "--seed", "11", "--dtype", dtype];
    let one = tiny(1, &common);
    assert_eq!(one.len(), 8);
    assert!(
        one[7].1 < one[0].1,
        "{dtype}: training makes progress: {one:?}"
    );
    for (n, layout) in layouts {
        let mut args = common.to_vec();
        args.extend_from_slice(layout);
        let c = tiny(*n, &args);
        assert_eq!(c.len(), one.len(), "{layout:?}: {c:?}");
        assert_close(format_args!("{dtype} {layout:?}"), &one, &c, tolerance);
    }
}

#[test]
fn pipelines_give_the_one_rank_curve_in_f64() {
    agree(
        "f64",
        1e-12,
        &[
            (1, &["--micro-batches", "4"]),
            (
                2,
                &["--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"],
            ),
            (
                2,
                &["--pp", "2", "--micro-batches", "4", "--schedule", "1f1b"],
            ),
            (
                2,
                &argv("--pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2"),
            ),
            (4, &["--pp", "4", "--micro-batches", "4"]),
            (
                4,
                &argv("--pp 2 --dp 2 --micro-batches 2 --zero 1 --recompute full"),
            ),
            (
                4,
                &argv(
                    "--pp 2 --tp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2 \
                    --sp",
                ),
            ),
            (
                8,
                &argv("--pp 2 --dp 2 --tp 2 --micro-batches 2 --zero 3 --recompute selective"),
            ),
        ],
    );
}

#[test]
fn pipelines_give_the_one_rank_curve_in_f32() {
    agree(
        "f32",
        1e-4,
        &[
            (
                2,
                &["--pp", "2", "--micro-batches", "2", "--schedule", "gpipe"],
            ),
            (
                4,
                &argv(
                    "--pp 2 --dp 2 --micro-batches 2 --zero 2 --schedule interleaved \
                    --virtual-stages 2",
                ),
            ),
        ],
    );
}

/// Rank 0's generated sample line.
fn sample(out: &str) -> String {
    out.lines()
        .find(|l| l.contains("sample (temperature"))
        .unwrap_or_else(|| panic!("no sample in {out}"))
        .to_string()
}

#[test]
fn dropout_and_generation_match_one_rank_through_stages() {
    let args = argv("--steps 6 --seed 5 --dtype f64 --dropout 0.1 --gen-tokens 12 --temperature 0");
    // TINY without its "--gen-tokens 0".
    let mut base: Vec<&str> = TINY[..10].to_vec();
    base.extend_from_slice(&TINY[12..]);
    base.extend_from_slice(&args);
    let one = ok(launch(1, &base));
    base.extend_from_slice(&["--pp", "2", "--tp", "2"]);
    let pp = ok(launch(4, &base));
    let diff = max_rel(&curve(&one), &curve(&pp));
    eprintln!("dropout 0.1, PP2xTP2: max relative difference {diff:.3e}");
    assert_eq!(curve(&pp).len(), 6);
    assert!(diff <= 1e-12, "dropout under PP2xTP2 differs by {diff:e}");
    assert_eq!(sample(&one), sample(&pp));
    // Micro-batches draw their rows of the whole batch's masks: 2 micro-batches through an
    // interleaved PP2xDP2 pipeline give the unsplit batch's curve with dropout on.
    base.truncate(base.len() - 4);
    base.extend_from_slice(&argv(
        "--pp 2 --dp 2 --micro-batches 2 --schedule interleaved --virtual-stages 2",
    ));
    let micro = ok(launch(4, &base));
    let diff = max_rel(&curve(&one), &curve(&micro));
    eprintln!(
        "dropout 0.1, PP2xDP2 interleaved, 2 micro-batches: max relative difference {diff:.3e}"
    );
    assert_eq!(curve(&micro).len(), 6);
    assert!(
        diff <= 1e-12,
        "dropout over micro-batches differs by {diff:e}"
    );
}

#[test]
fn the_bubble_line_reports_the_theory() {
    let out = tiny_out(
        2,
        &argv("--steps 3 --pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2"),
    );
    let line = out
        .lines()
        .find(|l| l.contains("bubble: measured"))
        .unwrap_or_else(|| panic!("no bubble line in {out}"));
    // (p - 1) / (v m + p - 1) = 1 / 9.
    assert!(line.contains("theory 11.1%"), "{line}");
    let measured: f64 = line
        .split("measured ")
        .nth(1)
        .and_then(|r| r.split('%').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!((0.0..100.0).contains(&measured), "{line}");
}

#[test]
fn a_checkpoint_resumes_across_pipeline_and_zero_layouts() {
    let base = ["--seed", "4", "--dtype", "f64"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        a
    };
    let full = tiny(1, &with(&["--steps", "10"]));
    assert_eq!(full.len(), 10);
    let pp2_zero: &[&str] = &argv("--pp 2 --dp 2 --micro-batches 2 --zero 2");
    let dp2tp2: &[&str] = &["--dp", "2", "--tp", "2", "--zero", "1"];
    for (name, save_at, resume_at) in [
        ("pp2dp2zero2-to-dp2tp2", pp2_zero, dp2tp2),
        ("dp2tp2-to-pp2dp2zero2", dp2tp2, pp2_zero),
    ] {
        let dir = common::scratch_dir("pp", name);
        let p = dir.join("ckpt");
        let ps: &'static str = Box::leak(p.to_str().unwrap().to_string().into_boxed_str());
        let first = tiny(
            4,
            &[with(&["--steps", "6", "--save", ps]), save_at.to_vec()].concat(),
        );
        assert_eq!(first.len(), 6);
        let resumed = tiny(
            4,
            &[with(&["--steps", "10", "--resume", ps]), resume_at.to_vec()].concat(),
        );
        assert_eq!(resumed.first().map(|c| c.0), Some(7), "{name}: {resumed:?}");
        assert_close(
            format_args!("{name}: resumed curve"),
            &full[6..],
            &resumed,
            1e-12,
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn invalid_pipelines_are_refused_on_every_rank() {
    let cases: [(usize, &[&str], &str); 4] = [
        (
            2,
            &argv(
                "--pp 2 --micro-batches 3 --schedule interleaved --virtual-stages 2 --batch-size 6",
            ),
            "multiple of the pipeline stages",
        ),
        (
            2,
            &argv("--pp 2 --micro-batches 2 --schedule interleaved --virtual-stages 3"),
            "multiple of stages x virtual stages",
        ),
        (
            4,
            &argv("--pp 2 --dp 2 --micro-batches 4 --batch-size 12"),
            "--batch-size 12 must be a multiple of --dp 2 x --micro-batches 4",
        ),
        (
            3,
            &["--pp", "2"],
            "--pp 2 x --tp 1 does not divide the world size 3",
        ),
    ];
    for (n, args, want) in cases {
        let mut all = TINY.to_vec();
        all.retain(|a| *a != "--batch-size" && *a != "8");
        all.extend_from_slice(args);
        common::assert_refused(n, &all, want);
    }
}
