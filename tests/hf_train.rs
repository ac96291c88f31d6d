//! `train --from-hf` under `oflaunch` with real processes (CPU/TCP backend), against the
//! transformers references of `tests/fixtures/hf` (made by `scripts/hf_fixtures.py`):
//! `--eval-only` prints transformers' float64 loss within 1e-9 relative for GPT-2, Llama,
//! Qwen2 and Mistral on 1 rank and under `--tp 2`, `--dp 2`, `--pp 2`, `--cp 2` and
//! `--cp 2 --dp 2` (the sequence split in load-balanced chunks); `--save-hf` writes a
//! directory `--from-hf` reads back to the same loss bit for bit, after training steps too;
//! and each mismatch of a directory (architecture, missing, unexpected, shape, dtype, an index
//! naming a missing file, a sliding window that matters) is a typed error naming the file and
//! the tensor, the same on every rank, before any step.

mod common;

use std::path::{Path, PathBuf};

use common::{
    eval_hf, from_hf, generated_ids, greedy_hf, hf_fixtures, hf_greedy_ids, hf_reference, launch,
    ok, rank_alone, save_hf_round_trip,
};

fn tmp(name: &str) -> PathBuf {
    common::scratch_dir("hf", name)
}

/// `train --from-hf DIR --eval-only` on the fixture tokens, on `nproc` ranks.
fn eval(nproc: usize, dir: &Path, extra: &[&str]) -> (f64, usize) {
    let data = hf_fixtures().join("tokens.bin");
    eval_hf(nproc, dir.to_str().unwrap(), data.to_str().unwrap(), extra)
}

const MODELS: [&str; 4] = ["gpt2", "llama", "qwen2", "mistral"];

/// One rank, then two ranks under each parallel axis.
const LAYOUTS: [(usize, &[&str]); 4] = [
    (1, &[]),
    (2, &["--tp", "2"]),
    (2, &["--dp", "2"]),
    (2, &["--pp", "2"]),
];

#[test]
fn eval_only_equals_transformers_on_every_layout() {
    // Evaluation also runs on a sequence split over a context-parallel axis.
    let cp: [(usize, &[&str]); 2] = [(2, &["--cp", "2"]), (4, &["--cp", "2", "--dp", "2"])];
    for name in MODELS {
        let m = hf_reference(name);
        let (want, tokens) = (
            m["eval_loss"].as_f64().unwrap(),
            m["tokens"].as_u64().unwrap(),
        );
        for (n, layout) in LAYOUTS.into_iter().chain(cp) {
            let (got, count) = eval(n, &hf_fixtures().join(name), layout);
            let rel = (got - want).abs() / want;
            eprintln!("{name} {layout:?}: {got} vs transformers {want} (relative {rel:.2e})");
            assert_eq!(count as u64, tokens, "{name} {layout:?}");
            assert!(rel < 1e-9, "{name} {layout:?}: {got} vs {want}");
        }
    }
}

#[test]
fn save_hf_reads_back_to_the_same_loss_bit_for_bit() {
    let out = tmp("roundtrip");
    for name in MODELS {
        // As loaded, saved from tensor-parallel shards, read back on one rank: one rank's loss.
        let index = save_hf_round_trip(name, &out.join(name), eval);
        assert!(index["weight_map"]
            .as_object()
            .is_some_and(|m| !m.is_empty()));
    }
    // After training steps (a pipeline of two stages saving), checked against the trained
    // checkpoint's own evaluation.
    let trained = out.join("trained");
    let ckpt = out.join("ckpt");
    let data = hf_fixtures().join("tokens.bin");
    let (t, c) = (trained.to_str().unwrap(), ckpt.to_str().unwrap());
    let dir = hf_fixtures().join("qwen2");
    let (d, tokens) = (dir.to_str().unwrap(), data.to_str().unwrap());
    let train = from_hf(
        d,
        tokens,
        &["--steps", "3", "--pp", "2", "--save", c, "--save-hf", t],
    );
    ok(launch(2, &train));
    let resumed = eval(1, &dir, &["--resume", c]);
    let reloaded = eval(1, &trained, &[]);
    let untrained = eval(1, &dir, &[]);
    eprintln!("trained: checkpoint {resumed:?}, saved {reloaded:?}, before {untrained:?}");
    assert_eq!(resumed, reloaded);
    assert_ne!(resumed, untrained, "the steps changed nothing");
    let _ = std::fs::remove_dir_all(&out);
}

/// Rewrites the safetensors file `path` with `edit` applied to its (name, dtype, shape,
/// bytes) tensors.
fn rewrite(
    path: &Path,
    edit: impl Fn(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

#[test]
fn every_mismatch_is_a_typed_error_naming_the_file_and_tensor_on_every_rank() {
    let base = tmp("bad");
    let case = |n: &str| base.join(n);
    let qwen = |n: &str| common::hf_fixture_copy("qwen2", &case(n)).join("model.safetensors");
    let arch = common::hf_fixture_copy("gpt2", &case("arch"));
    common::set_hf_config(
        &arch,
        "architectures",
        serde_json::json!(["FalconForCausalLM"]),
    );
    let missing = qwen("missing");
    rewrite(&missing, |t| {
        t.retain(|x| x.0 != "model.layers.1.mlp.up_proj.weight")
    });
    let unexpected = qwen("unexpected");
    rewrite(&unexpected, |t| {
        let extra = t[0].clone();
        t.push((
            "model.layers.0.extra.weight".into(),
            extra.1,
            extra.2,
            extra.3,
        ));
    });
    let shape = qwen("shape");
    rewrite(&shape, |t| {
        let x = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
        x.2 = vec![x.2[0] / 2];
        x.3.truncate(x.3.len() / 2);
    });
    let dtype = qwen("dtype");
    rewrite(&dtype, |t| {
        let x = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
        x.1 = safetensors::Dtype::I16;
    });
    let index = common::hf_fixture_copy("llama", &case("index"));
    std::fs::remove_file(index.join("model-00003-of-00005.safetensors")).unwrap();
    let window = common::hf_fixture_copy("mistral", &case("window"));
    common::set_hf_config(&window, "sliding_window", serde_json::json!(8));
    let cases: Vec<(PathBuf, String)> = vec![
        (
            arch.clone(),
            format!(
                "{}: architecture FalconForCausalLM is not supported (supported: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM)",
                arch.join("config.json").display()
            ),
        ),
        (
            case("missing/qwen2"),
            format!(
                "{}: missing tensors [\"model.layers.1.mlp.up_proj.weight\"]",
                missing.display()
            ),
        ),
        (
            case("unexpected/qwen2"),
            format!(
                "{}: unexpected tensors [\"model.layers.0.extra.weight\"]",
                unexpected.display()
            ),
        ),
        (
            case("shape/qwen2"),
            format!(
                "{}: tensor model.norm.weight is [16], the configuration needs [32]",
                shape.display()
            ),
        ),
        (
            case("dtype/qwen2"),
            format!(
                "{}: tensor model.norm.weight is stored as I16",
                dtype.display()
            ),
        ),
        (
            index.clone(),
            format!(
                "{}: tensor model.layers.1.mlp.gate_proj.weight is in model-00003-of-00005.safetensors, which does not exist",
                index.join("model.safetensors.index.json").display()
            ),
        ),
        (
            window.clone(),
            format!(
                "{}: sliding_window: sliding-window attention of 8 tokens matters for windows of 16 tokens",
                window.join("config.json").display()
            ),
        ),
    ];
    let data = hf_fixtures().join("tokens.bin");
    let (_, train) = common::binaries();
    for (dir, want) in &cases {
        let (d, tokens) = (dir.to_str().unwrap(), data.to_str().unwrap());
        let args = [
            "--from-hf",
            d,
            "--eval-only",
            "--data",
            tokens,
            "--seq-len",
            "16",
        ];
        let out = launch(2, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{dir:?} was accepted");
        assert!(err.contains(&format!("train: {want}")), "{dir:?}: {err}");
        // Each rank alone, with no rendezvous to reach: the same refusal.
        let alone: Vec<String> = ["0", "1"]
            .iter()
            .map(|rank| {
                let o = rank_alone(train, &args, rank);
                assert!(!o.status.success());
                String::from_utf8_lossy(&o.stderr).into_owned()
            })
            .collect();
        assert_eq!(alone[0], alone[1]);
        assert!(alone[0].contains(want.as_str()), "{}", alone[0]);
        eprintln!("{}", alone[0].lines().next().unwrap_or(""));
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn greedy_generation_through_the_cache_equals_transformers_on_every_layout() {
    for name in MODELS {
        let want = hf_greedy_ids(name);
        let dir = hf_fixtures().join(name);
        for (n, layout) in LAYOUTS {
            // The first two prompts decode as one batch; the third alone.
            let args = greedy_hf(dir.to_str().unwrap(), "5,17,3;9,9,9;1,2,3,4,5,6,7", layout);
            let text = ok(launch(n, &args));
            assert!(common::curve(&text).is_empty(), "generating trains nothing");
            let got = generated_ids(&text);
            eprintln!("{name} {layout:?}: {got:?}");
            // Every step after a prompt runs as one compiled step over the fixed cache (one
            // program for each of the two cache sizes; a batch ends early at its EOS ids).
            let steps: usize = common::number_after(&text, "decoding steps: ");
            let line = format!(
                "decoding steps: {steps} compiled (2 programs, 0 replays as one device graph), 0 eager"
            );
            assert!(
                steps >= 2 && text.contains(&line),
                "{name} {layout:?}: {text}"
            );
            assert_eq!(got.len(), 3, "{text}");
            assert_eq!(
                [got[0].clone(), got[2].clone()],
                [want[0].clone(), want[1].clone()],
                "{name} {layout:?}"
            );
        }
    }
}

#[test]
fn a_warmed_up_generation_replays_the_warm_up_programs_and_gives_the_same_ids() {
    let dir = hf_fixtures().join("llama");
    let d = dir.to_str().unwrap();
    let text = ok(launch(
        2,
        &greedy_hf(d, "5,17,3", &["--gen-warmup", "2", "--tp", "2"]),
    ));
    assert_eq!(
        generated_ids(&text),
        vec![hf_greedy_ids("llama")[0].clone()],
        "{text}"
    );
    // The timed request compiles nothing: its one program is the warm-up's.
    assert!(
        text.contains("after 2 untimed warm-up runs")
            && text.contains("0.000 s of it compiling the decoding step")
            && text.contains("compiled (1 programs, 0 replays as one device graph), 0 eager"),
        "{text}"
    );
    let bad = launch(1, &["--from-hf", d, "--gen-warmup", "101"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("--gen-warmup"),
        "{err}"
    );
}

#[test]
fn generation_past_a_sliding_window_is_refused_before_any_step() {
    let base = tmp("window-gen");
    let dir = common::hf_fixture_copy("mistral", &base);
    common::set_hf_config(&dir, "sliding_window", serde_json::json!(20));
    let d = dir.to_str().unwrap();
    let gen = |n: &str| {
        let args = [
            "--from-hf",
            d,
            "--prompt-ids",
            "5,17,3",
            "--gen-tokens",
            n,
            "--temperature",
            "0",
        ];
        launch(1, &args)
    };
    // 3 + 17 tokens fit the window; 3 + 18 do not.
    assert_eq!(generated_ids(&ok(gen("17"))).len(), 1);
    let out = gen("18");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("sliding-window attention of 20 tokens matters for windows of 21 tokens"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&base);
}
