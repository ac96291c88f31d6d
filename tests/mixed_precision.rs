//! `--precision bf16-mixed` on CPU processes: bf16 copies of f32 master weights, bf16
//! activations, statistics and the loss in f32. The tiny GPT's curve tracks the f32 curve in
//! one rank and in DP2, TP2 with SP and DP2xTP2 (every layer's forward and backward, the
//! LayerNorm weight gradients from bf16 data and f32 statistics included), and each layout
//! gives one rank's bf16-mixed curve within bf16 rounding. ZeRO-1 and 2, with f32 master shards
//! and their bf16 copies gathered, give DP2's curve bit for bit, and the shards checkpoint like
//! any leaf: a DP2 run resumed from ZeRO-2's goes on along the same curve.

mod common;

use common::{curve, launch, max_rel, ok};

const STEPS: &str = "20";

fn run(nproc: usize, precision: &str, layout: &[&str]) -> Vec<(u64, f64)> {
    let c = run_to(nproc, precision, layout, STEPS);
    assert_eq!(c.len(), 20, "{precision} {layout:?}: {c:?}");
    c
}

/// The curve of a run to step `steps` under `layout` (and any checkpoint flags in it).
fn run_to(nproc: usize, precision: &str, layout: &[&str], steps: &str) -> Vec<(u64, f64)> {
    let mut args = common::TINY_GPT.to_vec();
    args.extend_from_slice(&["--steps", steps, "--seed", "5", "--lr", "0.01"]);
    args.extend_from_slice(&["--precision", precision]);
    args.extend_from_slice(layout);
    curve(&ok(launch(nproc, &args)))
}

#[test]
fn bf16_mixed_tracks_f32_and_every_layout_tracks_one_rank() {
    let f32_curve = run(1, "f32", &[]);
    let bf16 = run(1, "bf16-mixed", &[]);
    let gap = max_rel(&f32_curve, &bf16);
    assert!(
        gap < 0.02,
        "bf16-mixed vs f32: {gap:.2e}\n{f32_curve:?}\n{bf16:?}"
    );
    assert_ne!(f32_curve, bf16, "bf16-mixed ran in f32");
    let (first, last) = (bf16[0].1, bf16[19].1);
    assert!(last < first * 0.9, "bf16-mixed does not train: {bf16:?}");
    for (nproc, layout) in [
        (2, &["--dp", "2"][..]),
        (2, &["--tp", "2", "--sp"][..]),
        (4, &["--dp", "2", "--tp", "2"][..]),
    ] {
        let c = run(nproc, "bf16-mixed", layout);
        let gap = max_rel(&bf16, &c);
        assert!(
            gap < 0.02,
            "{layout:?} vs one rank: {gap:.2e}\n{bf16:?}\n{c:?}"
        );
    }
}

#[test]
fn zero_master_shards_give_dp2s_curve_and_resume_as_dp2() {
    let dir = std::env::temp_dir().join(format!("oxiflow-mixed-zero2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let zero2 = ["--dp", "2", "--zero", "2"];
    let whole = run(2, "bf16-mixed", &zero2);
    let dp2 = run(2, "bf16-mixed", &["--dp", "2"]);
    assert_eq!(whole, dp2, "ZeRO-2 against DP2");
    let zero1 = run(2, "bf16-mixed", &["--dp", "2", "--zero", "1"]);
    assert_eq!(zero1, dp2, "ZeRO-1 against DP2");
    let saved = run_to(
        2,
        "bf16-mixed",
        &[&zero2[..], &["--save", d]].concat(),
        "10",
    );
    assert_eq!(saved[..], whole[..10], "the saving run is ZeRO-2's");
    let resumed = run_to(2, "bf16-mixed", &["--dp", "2", "--resume", d], STEPS);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        resumed.iter().map(|p| p.0).collect::<Vec<_>>(),
        (11..=20).collect::<Vec<_>>(),
        "{resumed:?}"
    );
    assert_eq!(resumed[..], whole[10..], "DP2 from ZeRO-2's checkpoint");
}
