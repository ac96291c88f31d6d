//! `train --model llama` (RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied
//! output table) under `oflaunch` with real processes (CPU/TCP backend): the same model code
//! as the GPT on every layout, each giving one rank's loss curve in f64 to 1e-9: DP4, TP2 (the
//! two key/value heads split), TP4 (replicated: fewer key/value heads than ranks), DP2xTP2,
//! TP2 with sequence parallelism, pipelines (1F1B, interleaved), ZeRO 1-3, recomputation,
//! gradient accumulation, tied embeddings, `--compile`; bf16-mixed tracks one rank within
//! bf16 rounding; a Hugging Face Llama (llama3 rope scaling) fine-tunes to the same curve on
//! DP2, TP2 and PP2. Flags of another architecture are refused by name.

mod common;

use common::{argv, assert_close, curve, from_hf, launch, ok};

/// A tiny Llama: 4 blocks, width 32, 4 query and 2 key/value heads, MLP 48 wide.
const TINY: &str = "--model llama --layers 4 --width 32 --heads 4 --kv-heads 2 --ffn-width 48 \
    --seq-len 16 --batch-size 8 --gen-tokens 0 --rope-theta 500";

fn tiny(nproc: usize, args: &[&str]) -> Vec<(u64, f64)> {
    let mut all = argv(TINY);
    all.extend_from_slice(args);
    curve(&ok(launch(nproc, &all)))
}

fn agree(common: &[&str], tolerance: f64, layouts: &[(usize, &[&str])]) {
    let one = tiny(1, common);
    assert!(!one.is_empty());
    assert!(
        one[one.len() - 1].1 < one[0].1,
        "training makes progress: {one:?}"
    );
    for (n, layout) in layouts {
        let mut args = common.to_vec();
        args.extend_from_slice(layout);
        let c = tiny(*n, &args);
        assert_close(format_args!("{layout:?}"), &one, &c, tolerance);
    }
}

const F64: &str = "--steps 8 --seed 3 --dtype f64 --log-every 1";

#[test]
fn llama_layouts_give_the_one_rank_curve_in_f64() {
    agree(
        &argv(F64),
        1e-9,
        &[
            (4, &["--dp", "4"]),
            (2, &["--tp", "2"]),
            (4, &["--tp", "4"]),
            (4, &["--dp", "2", "--tp", "2"]),
            (2, &["--tp", "2", "--sp"]),
            (2, &["--dp", "2", "--zero", "1"]),
            (2, &["--dp", "2", "--zero", "2"]),
            (2, &["--dp", "2", "--zero", "3", "--recompute", "full"]),
            (2, &["--tp", "2", "--recompute", "selective"]),
            (1, &["--grad-accum", "2"]),
        ],
    );
}

#[test]
fn llama_pipelines_give_the_one_rank_curve_in_f64() {
    agree(
        &argv(F64),
        1e-9,
        &[
            (2, &["--pp", "2", "--micro-batches", "4"]),
            (
                2,
                &argv("--pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2"),
            ),
            (4, &["--pp", "2", "--tp", "2", "--micro-batches", "2"]),
        ],
    );
}

#[test]
fn tied_llama_and_compiled_steps_give_the_one_rank_curve() {
    let mut tied = argv(F64);
    tied.push("--tie-embeddings");
    agree(&tied, 1e-9, &[(2, &["--tp", "2"]), (2, &["--pp", "2"])]);
    let one = tiny(1, &argv(F64));
    for (n, layout) in [(1, &[][..]), (2, &["--dp", "2"][..])] {
        let mut args = argv(F64);
        args.extend_from_slice(layout);
        args.push("--compile");
        let c = tiny(n, &args);
        assert_close(format_args!("--compile {layout:?}"), &one, &c, 1e-9);
    }
}

#[test]
fn bf16_mixed_llama_tracks_one_rank() {
    let common = argv("--steps 10 --seed 3 --precision bf16-mixed --log-every 1");
    agree(
        &common,
        0.02,
        &[(2, &["--dp", "2"]), (2, &["--tp", "2", "--sp"])],
    );
}

#[test]
fn a_hugging_face_llama_fine_tunes_alike_on_every_layout() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
    let data = dir.join("../tokens.bin");
    let run = |n: usize, layout: &[&str]| {
        let mut args = from_hf(
            dir.to_str().unwrap(),
            data.to_str().unwrap(),
            &argv("--steps 6 --log-every 1 --lr 0.001"),
        );
        args.extend_from_slice(layout);
        curve(&ok(launch(n, &args)))
    };
    let one = run(1, &[]);
    assert_eq!(one.len(), 6);
    for (n, layout) in [
        (2, &["--dp", "2"][..]),
        (2, &["--tp", "2"][..]),
        (2, &["--pp", "2", "--micro-batches", "2"][..]),
    ] {
        assert_close(format_args!("{layout:?}"), &one, &run(n, layout), 1e-9);
    }
}

#[test]
fn flags_of_another_architecture_are_refused_by_name() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--model", "llama", "--recompute", "gelu"],
            "--recompute gelu: this model's MLP is SwiGLU",
        ),
        (&["--kv-heads", "2"], "--kv-heads (model.kv-heads)"),
        (&["--tie-embeddings"], "settings of --model llama"),
        (
            &["--model", "llama", "--heads", "4", "--kv-heads", "3"],
            "--kv-heads 3 does not divide --heads 4",
        ),
        (
            &["--from-hf", "tests/fixtures/hf/gpt2", "--layers", "3"],
            "come from --from-hf's config.json",
        ),
    ];
    for (args, want) in cases {
        let out = launch(1, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// The `generated ids: a,b,c` line of a run's output.
fn generated_ids(text: &str) -> String {
    text.lines()
        .find_map(|l| {
            l.split_once("generated ids: ")
                .map(|(_, ids)| ids.to_string())
        })
        .unwrap_or_else(|| panic!("no generated ids in: {text}"))
}

#[test]
fn a_checkpoint_generates_without_its_architecture_restated() {
    let dir = std::env::temp_dir().join(format!("oxiflow-llama-arch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ckpt = dir.join("ckpt");
    let cs = ckpt.to_str().unwrap();
    let mut train = argv(TINY);
    train.extend(["--steps", "3", "--dtype", "f64", "--save", cs]);
    ok(launch(1, &train));
    let prompt = [
        "--resume",
        cs,
        "--prompt-ids",
        "5,17,3",
        "--gen-tokens",
        "6",
        "--temperature",
        "0",
    ];
    // The architecture, without the training-only flags a run that only generates refuses.
    let mut restated = argv(
        "--model llama --layers 4 --width 32 --heads 4 --kv-heads 2 --ffn-width 48 \
         --seq-len 16 --rope-theta 500 --dtype f64",
    );
    restated.extend(prompt);
    let want = generated_ids(&ok(launch(1, &restated)));
    // The sizes, kv heads, FFN width, rope theta and dtype come from the checkpoint's
    // configuration, on another layout too.
    let alone = generated_ids(&ok(launch(1, &prompt)));
    assert_eq!(alone, want);
    let mut tp2 = prompt.to_vec();
    tp2.extend(["--tp", "2"]);
    assert_eq!(generated_ids(&ok(launch(2, &tp2))), want);
    // A flag given still wins, and a size that differs from the checkpoint's is refused by name.
    let mut other = prompt.to_vec();
    other.extend(["--layers", "2"]);
    let out = launch(1, &other);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a 2-block run resumed a 4-block checkpoint"
    );
    assert!(
        err.contains("layers 4") && err.contains("--layers 2"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
