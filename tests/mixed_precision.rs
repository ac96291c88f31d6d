//! `--precision bf16-mixed` on CPU processes: bf16 copies of f32 master weights, bf16
//! activations, statistics and the loss in f32. The tiny GPT's curve tracks the f32 curve in
//! one rank and in DP2, TP2 with SP and DP2xTP2 (every layer's forward and backward, the
//! LayerNorm weight gradients from bf16 data and f32 statistics included), and each layout
//! gives one rank's bf16-mixed curve within bf16 rounding.

mod common;

use common::{curve, launch, max_rel, ok};

const STEPS: &str = "20";

fn run(nproc: usize, precision: &str, layout: &[&str]) -> Vec<(u64, f64)> {
    let mut args = common::TINY_GPT.to_vec();
    args.extend_from_slice(&["--steps", STEPS, "--seed", "5", "--lr", "0.01"]);
    args.extend_from_slice(&["--precision", precision]);
    args.extend_from_slice(layout);
    let c = curve(&ok(launch(nproc, &args)));
    assert_eq!(c.len(), 20, "{precision} {layout:?}: {c:?}");
    c
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
