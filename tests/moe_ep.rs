//! Expert parallelism (`--ep`) under `oflaunch` with real processes (CPU/TCP backend), on the
//! mixture-of-experts fixtures of `tests/fixtures/hf` (Mixtral: 8 experts top-2; Qwen2-MoE: 6
//! experts top-4 with a shared expert): `--eval-only` under `--dp 2 --ep 2` and `--dp 4 --ep
//! 2` prints transformers' float64 loss within 1e-9 relative, and greedy generation under
//! `--dp 2 --ep 2` its ids; f64 training with a large load-balancing coefficient gives one
//! rank's curve within 1e-9 under EP2, EP4, EP2 x TP2, PP2 x EP2, EP2 with ZeRO-2, with
//! selective recomputation and compiled; `--save-hf` from expert shards reads back to the same loss;
//! `--explain` shows the experts split over the ep axis; and bad layouts are refused by name
//! on every rank before any step.

mod common;

use std::path::{Path, PathBuf};

use common::{
    argv, assert_close, curve, eval_fixture_text, from_hf, generated_ids, greedy_hf, hf_fixtures,
    hf_greedy_ids, hf_reference, launch, number_after, ok,
};

fn tmp(name: &str) -> PathBuf {
    common::scratch_dir("ep", name)
}

fn eval(nproc: usize, dir: &Path, extra: &[&str]) -> f64 {
    number_after(&eval_fixture_text(nproc, dir, extra), "eval loss ")
}

#[test]
fn eval_only_under_expert_parallelism_equals_transformers() {
    let layouts: [(usize, &[&str]); 2] = [
        (2, &["--dp", "2", "--ep", "2"]),
        (4, &["--dp", "4", "--ep", "2"]),
    ];
    for name in ["mixtral", "qwen2_moe"] {
        let want = hf_reference(name)["eval_loss"].as_f64().unwrap();
        for (n, layout) in layouts {
            let got = eval(n, &hf_fixtures().join(name), layout);
            let rel = (got - want).abs() / want;
            eprintln!("{name} {layout:?}: {got} vs {want} (relative {rel:.2e})");
            assert!(rel < 1e-9, "{name} {layout:?}: {got} vs {want}");
        }
    }
}

#[test]
fn greedy_generation_under_expert_parallelism_equals_transformers() {
    for name in ["mixtral", "qwen2_moe"] {
        let want = hf_greedy_ids(name);
        let dir = hf_fixtures().join(name);
        let layout = argv("--dp 2 --ep 2");
        let args = greedy_hf(dir.to_str().unwrap(), "5,17,3;1,2,3,4,5,6,7", &layout);
        let text = ok(launch(2, &args));
        assert_eq!(generated_ids(&text), want, "{name}: {text}");
    }
}

#[test]
fn save_hf_from_expert_shards_reads_back() {
    let out = tmp("roundtrip");
    let saved = out.join("mixtral");
    let s = saved.to_str().unwrap();
    eval(
        2,
        &hf_fixtures().join("mixtral"),
        &["--dp", "2", "--ep", "2", "--save-hf", s],
    );
    let before = eval(1, &hf_fixtures().join("mixtral"), &[]);
    let after = eval(1, &saved, &[]);
    assert_eq!(before, after, "saved under --ep 2 and read back");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn explain_shows_the_experts_split_over_the_ep_axis() {
    let (dir, data) = (
        hf_fixtures().join("mixtral"),
        hf_fixtures().join("tokens.bin"),
    );
    let mut args = vec![
        "--from-hf",
        dir.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    args.extend(argv(
        "--seq-len 16 --batch-size 4 --dtype f64 --dp 2 --ep 2 --explain",
    ));
    let text = ok(launch(2, &args));
    assert!(text.contains("ep 2"), "no ep axis in the mesh: {text}");
    // The mesh [dp 1, ep 2, tp 1]: experts split over ep, the router whole.
    let line = |name: &str| {
        text.lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
            .to_string()
    };
    for name in ["mlp.experts.gate.weight", "mlp.experts.down.weight"] {
        assert!(line(name).contains("as (B, S(0), S("), "{}", line(name));
    }
    let router = line("mlp.router.weight");
    assert!(router.contains("as (B, B, B)"), "{router}");
}

/// The arguments of `steps` f64 training steps of the model in `dir` on the fixture tokens.
fn train_args(dir: &Path, steps: usize, extra: &[&str]) -> Vec<String> {
    let data = hf_fixtures().join("tokens.bin");
    let steps = steps.to_string();
    let mut a = vec!["--steps", &steps, "--log-every", "1", "--lr", "0.003"];
    a.extend_from_slice(extra);
    from_hf(dir.to_str().unwrap(), data.to_str().unwrap(), &a)
        .into_iter()
        .map(String::from)
        .collect()
}

fn train_curve(dir: &Path, n: usize, layout: &[&str]) -> Vec<(u64, f64)> {
    let args = train_args(dir, 3, layout);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    curve(&ok(launch(n, &args)))
}

#[test]
fn training_under_expert_parallelism_gives_one_ranks_curve() {
    // A load-balancing coefficient large enough that a wrong routing count or a lost share of
    // its gradient moves the curve far beyond the tolerance.
    let base = tmp("train");
    for name in ["mixtral", "qwen2_moe"] {
        let dir = common::hf_fixture_copy(name, &base);
        common::set_hf_config(&dir, "router_aux_loss_coef", serde_json::json!(0.5));
        let one = train_curve(&dir, 1, &[]);
        assert_eq!(one.len(), 3);
        let mut cases: Vec<(usize, &[&str])> = vec![
            (2, &["--dp", "2", "--ep", "2"]),
            (4, &["--dp", "2", "--ep", "2", "--tp", "2"]),
            (4, &["--pp", "2", "--dp", "2", "--ep", "2"]),
            (4, &["--dp", "4", "--ep", "2", "--zero", "2"]),
            (2, &["--dp", "2", "--ep", "2", "--recompute", "selective"]),
            // A compiled step replays the exchanging kernel launch by launch: the counts it
            // sends are computed again at every replay.
            (2, &["--dp", "2", "--ep", "2", "--compile"]),
        ];
        if name == "mixtral" {
            // 8 experts: 2 on each of 4 ranks (Qwen2-MoE's 6 do not divide by 4).
            cases.push((4, &["--dp", "4", "--ep", "4"]));
        }
        for (n, layout) in cases {
            assert_close(
                format_args!("{name} {layout:?}"),
                &one,
                &train_curve(&dir, n, layout),
                1e-9,
            );
        }
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn bad_expert_layouts_are_refused_by_name_on_every_rank_before_any_step() {
    let base = tmp("bad");
    let topk = common::hf_fixture_copy("qwen2_moe", &base.join("topk"));
    common::set_hf_config(&topk, "num_experts_per_tok", serde_json::json!(7));
    let (mixtral, qwen, llama) = (
        hf_fixtures().join("mixtral"),
        hf_fixtures().join("qwen2_moe"),
        hf_fixtures().join("llama"),
    );
    let cases: Vec<(usize, Vec<String>, &str)> = vec![
        (
            2,
            train_args(&mixtral, 2, &["--dp", "2", "--ep", "4"]),
            "--ep 4 must divide --dp 2",
        ),
        (
            4,
            train_args(&qwen, 2, &["--dp", "4", "--ep", "4"]),
            "--ep 4 must divide the 6 experts",
        ),
        (
            2,
            train_args(&topk, 2, &["--dp", "2", "--ep", "2"]),
            "num_experts_per_tok",
        ),
        (
            2,
            train_args(&llama, 2, &["--dp", "2", "--ep", "2"]),
            "--ep 2 splits the experts of a mixture of experts",
        ),
    ];
    for (n, args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::assert_refused(n, &args, want);
    }
    let _ = std::fs::remove_dir_all(&base);
}
