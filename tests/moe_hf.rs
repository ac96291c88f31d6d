//! Mixtures of experts from Hugging Face under `oflaunch` with real processes (CPU/TCP
//! backend), against the transformers references of `tests/fixtures/hf` (random-weight
//! Mixtral, 8 experts top-2 renormalised; Qwen2-MoE, 6 experts top-4 not renormalised with a
//! gated shared expert; made by `scripts/hf_fixtures.py`): `--eval-only` prints transformers'
//! float64 loss within 1e-9 relative and its load-balancing loss within 1e-6 on 1 rank and
//! under `--tp 2`, `--dp 2` and `--pp 2`; greedy generation gives transformers' ids; `--save-hf`
//! writes transformers' tensor names and reads back to the same loss bit for bit; training in
//! f64 (the load-balancing loss included) gives one rank's curve to 1e-9 under DP2, TP2 and
//! pipelines (PP2 eager and compiled, PP2 x TP2, micro-batches, PP2 x DP2 with and without
//! ZeRO-2);
//! and what is not supported is refused by name before any step.

mod common;

use std::path::{Path, PathBuf};

use common::{
    assert_close, curve, eval_fixture_text, generated_ids, greedy_hf, hf_fixtures, hf_greedy_ids,
    hf_reference, launch, number_after, ok, save_hf_round_trip,
};

const MODELS: [&str; 2] = ["mixtral", "qwen2_moe"];

/// A loss curve: (step, loss) pairs.
type Curve = [(u64, f64)];

fn tmp(name: &str) -> PathBuf {
    common::scratch_dir("moe", name)
}

/// `train --from-hf DIR --eval-only` on the fixture tokens in f64 on `nproc` ranks: (loss,
/// load-balancing loss).
fn eval(nproc: usize, dir: &Path, extra: &[&str]) -> (f64, f64) {
    let text = eval_fixture_text(nproc, dir, extra);
    (
        number_after(&text, "eval loss "),
        number_after(&text, "eval router aux loss "),
    )
}

#[test]
fn eval_only_equals_transformers_on_every_layout() {
    let layouts: [(usize, &[&str]); 4] = [
        (1, &[]),
        (2, &["--tp", "2"]),
        (2, &["--dp", "2"]),
        (2, &["--pp", "2"]),
    ];
    for name in MODELS {
        let r = hf_reference(name);
        let (want, want_aux) = (
            r["eval_loss"].as_f64().unwrap(),
            r["aux_loss"].as_f64().unwrap(),
        );
        for (n, layout) in layouts {
            let (got, aux) = eval(n, &hf_fixtures().join(name), layout);
            let rel = (got - want).abs() / want;
            eprintln!(
                "{name} {layout:?}: {got} vs {want} (relative {rel:.2e}); aux {aux} vs {want_aux}"
            );
            assert!(rel < 1e-9, "{name} {layout:?}: {got} vs {want}");
            assert!(
                (aux - want_aux).abs() < 1e-6,
                "{name} {layout:?}: aux {aux} vs {want_aux}"
            );
        }
    }
}

#[test]
fn greedy_generation_equals_transformers() {
    for name in MODELS {
        let want = hf_greedy_ids(name);
        let dir = hf_fixtures().join(name);
        for (n, layout) in [(1, &[][..]), (2, &["--tp", "2"][..])] {
            let args = greedy_hf(dir.to_str().unwrap(), "5,17,3;1,2,3,4,5,6,7", layout);
            let got = generated_ids(&ok(launch(n, &args)));
            eprintln!("{name} {layout:?}: {got:?}");
            assert_eq!(got, want, "{name} {layout:?}");
        }
    }
}

#[test]
fn save_hf_writes_transformers_names_and_reads_back_bit_for_bit() {
    let out = tmp("roundtrip");
    for name in MODELS {
        // Saved from tensor-parallel shards (the experts split), read back on one rank.
        let index = save_hf_round_trip(name, &out.join(name), eval);
        let mut keys: Vec<String> = index["weight_map"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        keys.sort();
        let want = hf_reference(name)["saved_keys"].clone();
        let mut want: Vec<String> = serde_json::from_value(want).unwrap();
        want.sort();
        assert_eq!(keys, want, "{name}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// Rank 0's loss curve of `steps` f64 training steps of the model in `dir` on the fixture
/// tokens on `n` ranks under `layout`.
fn train_curve(dir: &Path, n: usize, steps: usize, layout: &[&str]) -> Vec<(u64, f64)> {
    let data = hf_fixtures().join("tokens.bin");
    let steps = steps.to_string();
    let mut args = vec![
        "--from-hf",
        dir.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--steps",
        &steps,
        "--log-every",
        "1",
        "--dtype",
        "f64",
        "--gen-tokens",
        "0",
        "--lr",
        "0.003",
    ];
    args.extend_from_slice(layout);
    curve(&ok(launch(n, &args)))
}

#[test]
fn training_with_the_load_balancing_loss_gives_one_ranks_curve() {
    for name in MODELS {
        let dir = hf_fixtures().join(name);
        let run = |n: usize, layout: &[&str]| train_curve(&dir, n, 5, layout);
        let one = run(1, &[]);
        assert_eq!(one.len(), 5);
        for (n, layout) in [(2, &["--dp", "2"][..]), (2, &["--tp", "2"][..])] {
            assert_close(
                format_args!("{name} {layout:?}"),
                &one,
                &run(n, layout),
                1e-9,
            );
        }
    }
}

#[test]
fn pipelines_train_with_the_load_balancing_loss_as_one_rank() {
    // A coefficient large enough that a stage's missing share of the loss or of its gradient
    // moves the curve far beyond the tolerance.
    let base = tmp("pipeline");
    for name in MODELS {
        let dir = common::hf_fixture_copy(name, &base);
        common::set_hf_config(&dir, "router_aux_loss_coef", serde_json::json!(0.5));
        let run = |n: usize, layout: &[&str]| train_curve(&dir, n, 4, layout);
        // The loss of a micro-batch has its own load-balancing term: pipelines of two
        // micro-batches equal one rank accumulating two parts.
        let whole = run(1, &[]);
        let parts = run(1, &["--grad-accum", "2"]);
        assert_eq!(whole.len(), 4);
        let cases: [(&Curve, usize, &[&str]); 7] = [
            (&whole, 2, &["--pp", "2"]),
            (&whole, 2, &["--pp", "2", "--compile"]),
            (&whole, 4, &["--pp", "2", "--tp", "2"]),
            (&parts, 1, &["--micro-batches", "2"]),
            (&parts, 2, &["--pp", "2", "--micro-batches", "2"]),
            (
                &parts,
                4,
                &["--pp", "2", "--dp", "2", "--micro-batches", "2"],
            ),
            (
                &parts,
                4,
                &[
                    "--pp",
                    "2",
                    "--dp",
                    "2",
                    "--zero",
                    "2",
                    "--micro-batches",
                    "2",
                ],
            ),
        ];
        for (want, n, layout) in cases {
            assert_close(
                format_args!("{name} {layout:?}"),
                want,
                &run(n, layout),
                1e-9,
            );
        }
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn what_is_not_supported_is_refused_by_name_on_every_rank_before_any_step() {
    let base = tmp("bad");
    let data = hf_fixtures().join("tokens.bin");
    let case = |n: &str, fixture: &str, key: &str, v: serde_json::Value| {
        let d = common::hf_fixture_copy(fixture, &base.join(n));
        common::set_hf_config(&d, key, v);
        d
    };
    let train = |dir: &Path, extra: &[&str]| {
        let mut a = vec![
            "--from-hf".to_string(),
            dir.to_str().unwrap().to_string(),
            "--data".into(),
            data.to_str().unwrap().into(),
            "--seq-len".into(),
            "16".into(),
            "--batch-size".into(),
            "4".into(),
            "--steps".into(),
            "2".into(),
            "--gen-tokens".into(),
            "0".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    // Each config key set to a value the model does not support, refused by the key's name.
    let mut cases: Vec<(usize, Vec<String>, &str)> = [
        (
            2,
            "topk",
            "qwen2_moe",
            "num_experts_per_tok",
            serde_json::json!(7),
        ),
        (
            1,
            "dense",
            "qwen2_moe",
            "mlp_only_layers",
            serde_json::json!([1]),
        ),
        (
            1,
            "step",
            "qwen2_moe",
            "decoder_sparse_step",
            serde_json::json!(2),
        ),
        (
            1,
            "jitter",
            "mixtral",
            "router_jitter_noise",
            serde_json::json!(0.1),
        ),
    ]
    .into_iter()
    .map(|(n, name, fixture, key, v)| (n, train(&case(name, fixture, key, v), &[]), key))
    .collect();
    let mixtral = hf_fixtures().join("mixtral");
    cases.push((
        1,
        train(&mixtral, &["--recompute", "full"]),
        "--recompute full",
    ));
    for (n, args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::assert_refused(n, &args, want);
    }
    let _ = std::fs::remove_dir_all(&base);
}
