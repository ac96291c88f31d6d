//! LoRA fine-tuning under `oflaunch` with real processes (CPU/TCP backend) on the Llama fixture
//! of `tests/fixtures/hf`: training with `--lora-rank` equals one rank on `--tp 2`, `--dp 2`
//! (also with ZeRO-1), `--pp 2`, `--tp 2 --sp --recompute full` and `--cp 2` (f64, 1e-9
//! relative); a run resumed from its checkpoint (saved under another layout) continues the same
//! curve; `--save-hf --merge-lora` writes a model `--from-hf --eval-only` reads back to the eval
//! loss of the adapted model (its checkpoint resumed); without `--merge-lora` the adapters alone
//! are written in PEFT's layout; the checkpoint holds the adapters and their optimizer state,
//! not the base; bad input is refused by name before any step; and a table of trainable
//! parameters, parameter, gradient and optimizer bytes and step time against a full fine-tune.

mod common;

use std::path::{Path, PathBuf};

use common::{argv, curve, eval_hf, from_hf, hf_fixtures, launch, max_rel, number_after, ok};

fn tmp(name: &str) -> PathBuf {
    common::scratch_dir("lora", name)
}

const TARGETS: &str = "q,k,v,o,gate,up,down";

/// LoRA training flags: rank 4, every layer, a learning rate that moves the adapters.
const LORA: [&str; 8] = [
    "--lora-rank",
    "4",
    "--lora-alpha",
    "8",
    "--lora-targets",
    TARGETS,
    "--lr",
    "0.02",
];

fn llama() -> String {
    hf_fixtures().join("llama").to_str().unwrap().to_string()
}

fn data() -> String {
    hf_fixtures()
        .join("tokens.bin")
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn lora_training_equals_one_rank_on_tp2_and_dp2() {
    let (dir, data) = (llama(), data());
    let run = |n: usize, layout: &[&str]| {
        let mut extra = LORA.to_vec();
        extra.extend_from_slice(&["--steps", "4", "--log-every", "1"]);
        extra.extend_from_slice(layout);
        let text = ok(launch(n, &from_hf(&dir, &data, &extra)));
        assert!(text.contains("lora: rank 4 alpha 8"), "{text}");
        curve(&text)
    };
    let one = run(1, &[]);
    assert_eq!(one.len(), 4, "{one:?}");
    assert!(
        one[3].1 < one[0].1 - 1e-4,
        "the adapters did not train: {one:?}"
    );
    for layout in [
        &["--tp", "2"][..],
        &["--dp", "2"],
        &["--dp", "2", "--zero", "1"],
        &["--pp", "2"],
        &["--tp", "2", "--sp", "--recompute", "full"],
        &["--cp", "2"],
    ] {
        let got = run(2, layout);
        let rel = max_rel(&one, &got);
        eprintln!("{layout:?}: {got:?} vs one rank {one:?} (relative {rel:.2e})");
        assert!(rel < 1e-9, "{layout:?}: relative {rel:e}");
    }
}

#[test]
fn a_resumed_lora_run_continues_the_same_curve() {
    let out = tmp("resume");
    let (dir, data) = (llama(), data());
    let ckpt = out.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut e = LORA.to_vec();
        e.extend_from_slice(&["--log-every", "1"]);
        e.extend_from_slice(extra);
        curve(&ok(launch(2, &from_hf(&dir, &data, &e))))
    };
    let straight = run(&["--steps", "4", "--tp", "2"]);
    run(&["--steps", "2", "--dp", "2", "--save", c]);
    let resumed = run(&["--steps", "4", "--tp", "2", "--resume", c]);
    eprintln!("straight {straight:?} resumed {resumed:?}");
    assert_eq!(resumed.len(), 2, "{resumed:?}");
    let rel = max_rel(&straight[2..], &resumed);
    assert!(rel < 1e-9, "relative {rel:e}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn merged_export_reloads_to_the_adapted_models_eval_loss() {
    let out = tmp("merge");
    let (dir, data) = (llama(), data());
    let (ckpt, merged, adapter) = (out.join("ckpt"), out.join("merged"), out.join("adapter"));
    let (c, m, a) = (
        ckpt.to_str().unwrap(),
        merged.to_str().unwrap(),
        adapter.to_str().unwrap(),
    );
    // Trained on two tensor-parallel ranks, saved merged; then the same run saving the
    // adapters alone.
    let mut extra = LORA.to_vec();
    extra.extend_from_slice(&[
        "--steps",
        "3",
        "--tp",
        "2",
        "--save",
        c,
        "--save-hf",
        m,
        "--merge-lora",
    ]);
    let text = ok(launch(2, &from_hf(&dir, &data, &extra)));
    assert!(text.contains("LoRA adapters merged"), "{text}");
    let mut extra = LORA.to_vec();
    extra.extend_from_slice(&["--steps", "3", "--tp", "2", "--save-hf", a]);
    ok(launch(2, &from_hf(&dir, &data, &extra)));

    let eval = |d: &str, extra: &[&str]| eval_hf(1, d, &data, extra);
    let mut adapted_flags = LORA[..6].to_vec();
    adapted_flags.extend_from_slice(&["--resume", c]);
    let adapted = eval(&dir, &adapted_flags);
    let reloaded = eval(m, &[]);
    let base = eval(&dir, &[]);
    let rel = (adapted.0 - reloaded.0).abs() / adapted.0;
    eprintln!(
        "eval: base {base:?} adapted {adapted:?} merged and reloaded {reloaded:?} ({rel:.2e})"
    );
    assert_eq!(adapted.1, reloaded.1);
    assert!(rel < 1e-9, "merged {reloaded:?} vs adapted {adapted:?}");
    assert!(
        (adapted.0 - base.0).abs() > 1e-6,
        "the adapters changed nothing"
    );

    // The checkpoint holds the adapters (and their moments), not the base.
    let manifest = walk(&ckpt)
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|x| x == "manifest.json"))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect::<String>();
    assert!(manifest.contains("lora_A") && manifest.contains("lora_B"));
    assert!(
        !manifest.contains("attn.q.weight") && !manifest.contains("wte.weight"),
        "the checkpoint holds base weights"
    );

    // PEFT's layout: every adapted module's lora_A [r, in] and lora_B [out, r], and the config.
    let bytes = std::fs::read(adapter.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let q = st
        .tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        .unwrap();
    assert_eq!(q.shape(), &[4, 48]);
    let k = st
        .tensor("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight")
        .unwrap();
    assert_eq!(k.shape(), &[16, 4]);
    let down = st
        .tensor("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight")
        .unwrap();
    assert_eq!(down.shape(), &[4, 64]);
    assert_eq!(st.names().len(), 2 * 7 * 2);
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["lora_alpha"].as_f64(), Some(8.0));
    assert_eq!(cfg["peft_type"], "LORA");
    let targets: Vec<&str> = cfg["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        targets,
        argv("q_proj k_proj v_proj o_proj gate_proj up_proj down_proj")
    );
    let _ = std::fs::remove_dir_all(&out);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Rank 0's (and every rank's) error of a job that must fail before its first step.
fn refused(n: usize, extra: &[&str], want: &[&str]) {
    let (dir, data) = (llama(), data());
    let mut e = vec!["--steps", "2"];
    e.extend_from_slice(extra);
    let out = launch(n, &from_hf(&dir, &data, &e));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{extra:?} ran: {text}");
    assert!(!text.contains("step 1 loss"), "{extra:?} stepped: {text}");
    for w in want {
        assert!(text.contains(w), "{extra:?}: no {w:?} in {text}");
    }
}

#[test]
fn bad_lora_input_is_refused_by_name_before_any_step() {
    refused(1, &["--lora-rank", "0"], &["--lora-rank"]);
    refused(
        2,
        &["--lora-rank", "17", "--lora-targets", "q,k", "--tp", "2"],
        &["rank 17 is above min(in 48, out 16) = 16", "attn.k"],
    );
    refused(
        1,
        &["--lora-rank", "2", "--lora-targets", "q,c_fc"],
        &["LoRA target \"c_fc\"", "q,k,v,o,gate,up,down"],
    );
    refused(
        1,
        &["--merge-lora", "--save-hf", "/tmp/x"],
        &["--merge-lora", "--lora-rank"],
    );
    refused(
        1,
        &["--lora-rank", "2", "--merge-lora"],
        &["--merge-lora", "--save-hf"],
    );
    refused(
        1,
        &["--lora-rank", "2", "--lora-dropout", "0.1"],
        &["--lora-dropout 0.1"],
    );
    refused(1, &["--lora-rank", "2", "--compile"], &["--compile"]);
    refused(
        1,
        &["--lora-alpha", "4"],
        &["--lora-alpha", "--lora-rank is not given"],
    );
}

/// What a run's output says it cost.
#[derive(Debug)]
struct Costs {
    trainable: usize,
    parameter_bytes: usize,
    gradient_bytes: usize,
    optimizer_bytes: usize,
    seconds_per_step: f64,
}

/// The costs a run's output shows, for steps of `tokens` tokens.
fn costs(text: &str, tokens: usize) -> Costs {
    let parameter_bytes = number_after::<usize>(text, ": parameters ");
    let tokens_per_s = number_after::<usize>(text, " tokens/s ").max(1);
    Costs {
        // A full fine-tune trains every parameter: its f32 bytes over 4.
        trainable: if text.contains("trainable parameters ") {
            number_after(text, "trainable parameters ")
        } else {
            parameter_bytes / 4
        },
        parameter_bytes,
        gradient_bytes: number_after(text, " gradients "),
        optimizer_bytes: number_after(text, "optimizer-state "),
        seconds_per_step: tokens as f64 / tokens_per_s as f64,
    }
}

#[test]
fn lora_costs_against_a_full_fine_tune() {
    // A bigger random Llama built from flags, so the adapters are small beside it.
    let model = argv(
        "--model llama --layers 4 --width 256 --heads 8 --kv-heads 4 --ffn-width 768 \
        --seq-len 128 --batch-size 8 --steps 6 --gen-tokens 0",
    );
    let run = |extra: &[&str]| {
        let mut a = model.to_vec();
        a.extend_from_slice(extra);
        costs(&ok(launch(1, &a)), 8 * 128)
    };
    let lora_flags = ["--lora-rank", "8", "--lora-targets", TARGETS];
    let rows = [
        ("full, f32", run(&[])),
        ("LoRA r8 on q,k,v,o,gate,up,down, f32", run(&lora_flags)),
        ("full, bf16-mixed", run(&["--precision", "bf16-mixed"])),
        (
            "LoRA r8, bf16-mixed (base stored bf16)",
            run(&[&lora_flags[..], &["--precision", "bf16-mixed"]].concat()),
        ),
    ];
    let [(_, full), (_, lora), (_, full_bf16), (_, lora_bf16)] = &rows;
    // The step time is reported, not asserted: on a shared CPU it is noise-bound.
    println!(
        "| fine-tune (CPU, 1 rank, 1024 tokens a step) | trainable parameters | parameter bytes \
         | gradient bytes | optimizer bytes | s/step |"
    );
    println!("|---|---|---|---|---|---|");
    for (what, c) in &rows {
        // A full fine-tune trains every parameter (the f32 run's count).
        let trainable = if c.trainable == lora.trainable {
            lora.trainable
        } else {
            full.trainable
        };
        println!(
            "| {what} | {trainable} | {} | {} | {} | {:.3} |",
            c.parameter_bytes, c.gradient_bytes, c.optimizer_bytes, c.seconds_per_step
        );
    }
    assert!(lora.trainable * 10 < full.trainable, "{lora:?} vs {full:?}");
    // The optimizer holds two f32 moments per trainable parameter, nothing for the base.
    assert_eq!(full.optimizer_bytes, 8 * full.trainable, "{full:?}");
    assert_eq!(lora.optimizer_bytes, 8 * lora.trainable, "{lora:?}");
    assert_eq!(lora_bf16.optimizer_bytes, lora.optimizer_bytes);
    // Gradients of the adapters only.
    assert_eq!(lora.gradient_bytes, 4 * lora.trainable, "{lora:?}");
    assert_eq!(full.gradient_bytes, 4 * full.trainable, "{full:?}");
    // The frozen base in bf16 (2 bytes, no master copy); the adapters f32 masters with their
    // bf16 compute copies (6 bytes); a full bf16-mixed fine-tune keeps both for everything.
    let base = full.trainable;
    assert_eq!(
        lora_bf16.parameter_bytes,
        2 * base + 6 * lora.trainable,
        "{lora_bf16:?}"
    );
    assert_eq!(full_bf16.parameter_bytes, 6 * base, "{full_bf16:?}");
}

/// The refusal of `train args` under an address-space limit of `kib` KiB (stderr).
fn refused_under_limit(args: &[&str], kib: u64) -> String {
    let (_, train) = common::binaries();
    let mut line = format!("ulimit -v {kib}; exec {}", train.display());
    for a in args {
        line.push(' ');
        line.push_str(a);
    }
    let out = std::process::Command::new("sh")
        .args(["-c", &line])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{args:?} ran: {text}");
    text
}

/// The size the refusal `text` gives its part `key` (", gradients ", ...), in bytes.
fn part(text: &str, key: &str) -> f64 {
    let l = text
        .split("per rank at least ")
        .nth(1)
        .and_then(|parts| parts.split(key).nth(1))
        .unwrap_or_else(|| panic!("no {key:?} in {text}"));
    let mut w = l.split_whitespace();
    let v: f64 = w
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no size after {key:?} in {text}"));
    let unit = w.next().unwrap().trim_end_matches(',');
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        other => panic!("unit {other} in {text}"),
    };
    v * scale
}

#[test]
fn the_memory_estimate_counts_gradients_and_state_of_the_adapters_only() {
    // A Llama of about 537 M parameters (2.1 GB in f32) under a 1.4 GB address space: refused
    // before anything big is allocated, with the estimate's parts named.
    let model = argv(
        "--model llama --layers 8 --width 2048 --heads 16 --ffn-width 8192 --seq-len \
        32 --batch-size 2 --steps 1 --gen-tokens 0",
    );
    let full = refused_under_limit(&model, 1_400_000);
    let lora = refused_under_limit(
        &[&model[..], &["--lora-rank", "8", "--lora-targets", "q,v"]].concat(),
        1_400_000,
    );
    let (fg, lg) = (part(&full, ", gradients "), part(&lora, ", gradients "));
    let (fo, lo) = (
        part(&full, ", optimizer state "),
        part(&lora, ", optimizer state "),
    );
    eprintln!("full: gradients {fg} state {fo}; LoRA: gradients {lg} state {lo}");
    // r (in + out) for q and v of 8 blocks: 8 x 8 x (2 x 4096) f32 values.
    let adapters = 8.0 * 8.0 * 8192.0;
    assert!((lg - 4.0 * adapters).abs() < 0.01 * lg, "{lora}");
    assert!((lo - 8.0 * adapters).abs() < 0.01 * lo, "{lora}");
    assert!(fg > 500.0 * lg, "{full}");
}
