//! Data-parallel gradients reduced in buckets during the backward pass (`--bucket-mb`), under
//! `oflaunch` with real processes (CPU backend): the tiny GPT's loss curve with small buckets
//! and 2 accumulation parts equals the one-rank curve under DP2, DP4, DP2 x TP2 and ZeRO-1/2/3
//! (f64), and the unbucketed run's bit for bit (f32); `--explain` names the buckets, several of
//! them launched while the backward pass still runs and all in the last accumulation part,
//! their bytes those of the whole model; `--bucket-mb 0` reduces none in buckets. Under
//! bf16-mixed the f32 gradients reach the buckets the same way (the bf16 -> f32 conversion of
//! each compute copy's gradient keeps it a partial sum), and `--reduce-dtype bf16` moves the
//! buckets as bf16, tracking the one-rank curve to bf16 rounding. With one data-parallel rank,
//! `--cp 2` fills the buckets with the partial sums over the context-parallel axis.

mod common;

use common::{argv, assert_close, curve, launch, max_rel, ok, TINY_GPT as TINY};

fn run(nproc: usize, args: &[&str]) -> String {
    let mut all = TINY.to_vec();
    all.extend_from_slice(args);
    ok(launch(nproc, &all))
}

/// `--explain` of the tiny GPT (its sizes and batch; no step lines or sample to set).
fn explained(nproc: usize, args: &[&str]) -> String {
    let mut all = TINY[..10].to_vec();
    all.push("--explain");
    all.extend_from_slice(args);
    ok(launch(nproc, &all))
}

#[test]
fn bucketed_reduction_keeps_the_one_rank_curve() {
    let common = argv("--steps 12 --seed 3 --dtype f64 --grad-accum 2 --bucket-mb 0.01");
    let one = curve(&run(1, &common));
    assert_eq!(one.len(), 12);
    for (n, layout) in [
        (2, &["--dp", "2"][..]),
        (4, &["--dp", "4"][..]),
        (4, &["--dp", "2", "--tp", "2"][..]),
        (4, &["--dp", "4", "--zero", "1"][..]),
        (4, &["--dp", "4", "--zero", "2"][..]),
        (4, &["--dp", "4", "--zero", "3"][..]),
        (4, &["--dp", "2", "--tp", "2", "--zero", "2"][..]),
    ] {
        let mut args = common.to_vec();
        args.extend_from_slice(layout);
        let c = curve(&run(n, &args));
        assert_close(format_args!("{layout:?}"), &one, &c, 1e-9);
    }
}

#[test]
fn f32_buckets_give_the_unbucketed_curve_bit_for_bit() {
    let common = argv("--steps 12 --seed 4 --dtype f32 --grad-accum 2");
    let one = curve(&run(1, &common));
    for layout in [&["--dp", "2"][..], &["--dp", "2", "--zero", "1"][..]] {
        let mut plain = common.to_vec();
        plain.extend_from_slice(layout);
        let mut small = plain.clone();
        small.extend_from_slice(&["--bucket-mb", "0.01"]);
        plain.extend_from_slice(&["--bucket-mb", "0"]);
        let (p, s) = (curve(&run(2, &plain)), curve(&run(2, &small)));
        assert_eq!(p, s, "f32 {layout:?}: buckets change the curve");
        let diff = max_rel(&one, &s);
        eprintln!("f32 {layout:?}: equal to unbucketed; {diff:.3e} from one rank");
        assert!(
            diff <= 1e-6,
            "f32 {layout:?} differs from one rank by {diff:e}"
        );
    }
}

/// The `--explain` bucket lines: (tensors, bytes, collective, part, during the walk).
fn buckets(out: &str) -> Vec<(usize, usize, String, usize, bool)> {
    let count: usize = out
        .lines()
        .find_map(|l| l.split("gradient buckets: ").nth(1))
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no bucket count in {out}"));
    let rows: Vec<_> = out
        .lines()
        .filter_map(|l| l.split("  bucket ").nth(1))
        .map(|t| {
            let w: Vec<&str> = t.split_whitespace().collect();
            (
                w[1].parse().unwrap(),
                w[3].parse().unwrap(),
                w[5].to_string(),
                w[7].parse().unwrap(),
                t.ends_with("during the backward pass"),
            )
        })
        .collect();
    assert_eq!(rows.len(), count, "{out}");
    rows
}

/// The buckets of an explained step on two ranks with `flags` then `extra`.
fn dp2_buckets(flags: &[&str], extra: &[&str]) -> Vec<(usize, usize, String, usize, bool)> {
    buckets(&explained(2, &[flags, extra].concat()))
}

#[test]
fn explain_names_buckets_launched_during_the_last_backward_pass() {
    let explain = |extra: &[&str]| dp2_buckets(&["--dp", "2", "--grad-accum", "2"], extra);
    let small = explain(&["--bucket-mb", "0.01"]);
    eprintln!("--bucket-mb 0.01: {small:?}");
    assert!(small.len() >= 3, "{small:?}");
    assert!(small.iter().filter(|b| b.4).count() >= 2, "{small:?}");
    assert!(
        small.iter().all(|b| b.3 == 1),
        "only the last part reduces: {small:?}"
    );
    assert!(small.iter().all(|b| b.2 == "all-reduce"), "{small:?}");
    let whole = explain(&[]);
    assert_eq!(
        whole.len(),
        1,
        "one default bucket holds the tiny model: {whole:?}"
    );
    assert!(
        !whole[0].4,
        "a bucket that never fills is reduced at the end"
    );
    assert_eq!(
        small
            .iter()
            .map(|b| (b.0, b.1))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1)),
        (whole[0].0, whole[0].1),
        "the small buckets hold every gradient once"
    );
    assert!(explain(&["--bucket-mb", "0"]).is_empty());
    let zero2 = explain(&["--bucket-mb", "0.01", "--zero", "2"]);
    assert!(zero2.len() >= 3 && zero2.iter().all(|b| b.2 == "reduce-scatter" && b.3 == 1));
}

#[test]
fn mixed_precision_gradients_fill_the_buckets_and_may_move_as_bf16() {
    let explain = |extra: &[&str]| dp2_buckets(&["--dp", "2", "--bucket-mb", "0.01"], extra);
    let total = |b: &[(usize, usize, String, usize, bool)]| {
        b.iter().fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    let f32s = explain(&[]);
    let mixed = explain(&["--precision", "bf16-mixed"]);
    eprintln!("bf16-mixed: {mixed:?}");
    assert!(mixed.iter().filter(|b| b.4).count() >= 2, "{mixed:?}");
    assert!(mixed.iter().all(|b| b.2 == "all-reduce"), "{mixed:?}");
    // Every gradient, the norm weights' too (computed in f32, each rank's part rounded to
    // the bf16 compute copy: still a partial sum).
    let all = total(&f32s);
    assert_eq!(total(&mixed), all, "every f32 gradient, bucketed");
    // One rank has nothing to reduce: its partial sums are relabelled, never copied.
    let alone = buckets(&explained(
        1,
        &["--bucket-mb", "0.01", "--precision", "bf16-mixed"],
    ));
    assert!(alone.is_empty(), "{alone:?}");
    let wire = explain(&["--reduce-dtype", "bf16"]);
    assert!(wire.iter().all(|b| b.2 == "all-reduce(bf16)"), "{wire:?}");
    assert_eq!(total(&wire), all);
    let common = ["--steps", "12", "--seed", "5", "--bucket-mb", "0.01"];
    let one = curve(&run(1, &common));
    let mut args = common.to_vec();
    args.extend_from_slice(&["--dp", "2", "--reduce-dtype", "bf16"]);
    let diff = max_rel(&one, &curve(&run(2, &args)));
    eprintln!("--reduce-dtype bf16, DP2: {diff:.3e} from one rank (f32)");
    assert!(diff > 0.0 && diff <= 1e-2, "{diff:e}");
}

/// With one data-parallel rank, the gradients' partial sums over a context-parallel axis fill
/// the buckets instead: several reduced while the backward pass runs, and the curve is the
/// unbucketed run's bit for bit (f32).
#[test]
fn a_context_parallel_axis_reduces_in_buckets_without_data_parallelism() {
    let small = buckets(&explained(2, &["--cp", "2", "--bucket-mb", "0.01"]));
    eprintln!("--cp 2 --bucket-mb 0.01: {small:?}");
    assert!(small.len() >= 3, "{small:?}");
    assert!(small.iter().filter(|b| b.4).count() >= 2, "{small:?}");
    assert!(small.iter().all(|b| b.2 == "all-reduce"), "{small:?}");
    let f32_run = |mb: &str| curve(&run(2, &["--cp", "2", "--dtype", "f32", "--bucket-mb", mb]));
    assert_eq!(f32_run("0"), f32_run("0.01"), "buckets change the curve");
}
