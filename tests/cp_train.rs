//! `train --cp` under `oflaunch` with real processes (CPU/TCP backend): a context-parallel axis
//! splitting each sequence in load-balanced causal chunks gives one rank's loss curve in f64 to
//! 1e-9 for the GPT (learned positions) and the Llama (rotary positions, grouped-query
//! attention): CP2, CP4 over a sequence that does not divide, CP2 x DP2 and CP2 x TP2, by ring
//! and by all-to-all attention; PP2 x CP2, ZeRO 1 and 3 and recomputation beside CP2 too. At
//! seq 2048 a CP4 rank's step peak is at most 0.4 of one rank's; compiled CP2 (ring and
//! all-to-all) and CP2 x DP2 steps too. Generation with the KV cache split over the cp ranks
//! (prompts padded to whole chunks, each rank keeping its block of positions) gives one rank's
//! ids, greedy and sampled, past the model's positions too, for both models, beside TP and DP.
//! Bad layouts (a --cp that does not divide the world, alltoall with heads that do not divide,
//! a sequence shorter than 2 x cp chunks, --sp or a CUDA device beside --cp) are refused by
//! name before step 1 on every rank.
//! Under bf16-mixed (bf16 context attention with f32 softmax statistics) CP2 by ring and by
//! all-to-all tracks one rank's curve.

mod common;

use common::{argv, assert_close, curve, launch, max_rel, ok};

/// A tiny GPT: 2 blocks, width 32, 4 heads.
const GPT: &str = "--model gpt --layers 2 --width 32 --heads 4";

/// A tiny Llama: 2 blocks, width 32, 4 query and 2 key/value heads, MLP 48 wide.
const LLAMA: &str =
    "--model llama --layers 2 --width 32 --heads 4 --kv-heads 2 --ffn-width 48 --rope-theta 500";

/// f64 steps on 8 windows of `seq` tokens, the loss every step.
fn run(nproc: usize, model: &[&str], seq: &str, layout: &[&str]) -> Vec<(u64, f64)> {
    let mut args = model.to_vec();
    args.extend(["--seq-len", seq]);
    args.extend(argv(
        "--batch-size 8 --steps 6 --seed 3 --dtype f64 --log-every 1 --gen-tokens 0",
    ));
    args.extend_from_slice(layout);
    curve(&ok(launch(nproc, &args)))
}

/// Each layout's curve against one rank's, for `model` on windows of `seq` tokens.
fn agree(model: &[&str], seq: &str, layouts: &[(usize, &[&str])]) {
    let one = run(1, model, seq, &[]);
    assert_eq!(one.len(), 6, "{one:?}");
    assert!(one[5].1 < one[0].1, "training makes progress: {one:?}");
    for (n, layout) in layouts {
        let diff = max_rel(&one, &run(*n, model, seq, layout));
        eprintln!(
            "{} seq {seq} {layout:?}: max relative difference {diff:.3e}",
            model[1]
        );
        assert!(diff <= 1e-9, "{layout:?} differs by {diff:e}");
    }
}

const RING_LAYOUTS: [(usize, &[&str]); 4] = [
    (2, &["--cp", "2"]),
    (4, &["--cp", "2", "--dp", "2"]),
    (4, &["--cp", "2", "--tp", "2"]),
    (4, &["--cp", "2", "--dp", "2", "--cp-attention", "ring"]),
];

/// `model` agrees with one rank on 16 tokens in `RING_LAYOUTS`, then under all-to-all attention
/// on 2 ranks and in `alltoall_4` (4 ranks), then on 18 tokens in `at_18`.
fn agree_under_cp(model: &'static str, alltoall_4: &[&str], at_18: &[(usize, &[&str])]) {
    agree(&argv(model), "16", &RING_LAYOUTS);
    agree(
        &argv(model),
        "16",
        &[
            (2, &["--cp", "2", "--cp-attention", "alltoall"]),
            (4, alltoall_4),
        ],
    );
    agree(&argv(model), "18", at_18);
}

#[test]
fn gpt_under_cp_gives_the_one_rank_curve_in_f64() {
    // 18 tokens over 4 ranks: shares of 5, 5, 4, 4 in chunks of 3 + 2 and 2 + 2.
    agree_under_cp(
        GPT,
        &["--cp", "2", "--tp", "2", "--cp-attention", "alltoall"],
        &[
            (4, &["--cp", "4"]),
            (4, &["--cp", "4", "--cp-attention", "alltoall"]),
        ],
    );
}

#[test]
fn llama_under_cp_gives_the_one_rank_curve_in_f64() {
    agree_under_cp(
        LLAMA,
        &["--cp", "2", "--dp", "2", "--cp-attention", "alltoall"],
        &[(4, &["--cp", "4"])],
    );
}

#[test]
fn compiled_steps_under_cp_give_the_one_rank_curve_in_f64() {
    // The compiled step replays the exchanging attention kernels launch by launch; the
    // load-balanced order's rotary tables and position rows are made with the model.
    let compiled: [(usize, &[&str]); 3] = [
        (2, &["--cp", "2", "--compile"]),
        (2, &["--cp", "2", "--cp-attention", "alltoall", "--compile"]),
        (4, &["--cp", "2", "--dp", "2", "--compile"]),
    ];
    agree(&argv(LLAMA), "16", &compiled);
    agree(&argv(GPT), "16", &compiled[..1]);
}

#[test]
fn bad_context_parallel_layouts_are_refused_by_name_on_every_rank() {
    let cases: [(usize, &[&str], &str); 5] = [
        (
            2,
            &["--cp", "3"],
            "--cp 3 x --tp 1 does not divide the world size 2",
        ),
        (
            4,
            &argv("--cp 4 --cp-attention alltoall --model llama --kv-heads 2"),
            "--cp-attention alltoall splits the attention heads over --tp 1 x --cp 4 = 4 ranks",
        ),
        (
            4,
            &["--cp", "4", "--seq-len", "6"],
            "--seq-len 6 is shorter than the 2 x --cp 4 load-balanced chunks",
        ),
        (
            4,
            &["--cp", "2", "--tp", "2", "--sp"],
            "--sp and --cp both split the sequence",
        ),
        (
            2,
            &["--cp", "2", "--device", "cuda", "--seq-len", "6"],
            "--seq-len 6 does not cut into 2 x --cp 2 equal chunks",
        ),
    ];
    for (n, args, want) in cases {
        let mut all = argv("--layers 1 --width 16 --heads 4 --steps 1");
        all.extend_from_slice(args);
        common::assert_refused(n, &all, want);
    }
}

#[test]
fn bf16_mixed_under_cp_tracks_one_rank() {
    let bf16 = |n: usize, layout: &[&str]| {
        let mut args = argv(LLAMA);
        args.extend_from_slice(&[
            "--seq-len",
            "16",
            "--batch-size",
            "8",
            "--steps",
            "6",
            "--seed",
            "3",
            "--precision",
            "bf16-mixed",
            "--log-every",
            "1",
            "--gen-tokens",
            "0",
        ]);
        args.extend_from_slice(layout);
        curve(&ok(launch(n, &args)))
    };
    let one = bf16(1, &[]);
    assert_eq!(one.len(), 6, "{one:?}");
    for layout in [
        &["--cp", "2"][..],
        &["--cp", "2", "--cp-attention", "alltoall"],
    ] {
        assert_close(format_args!("{layout:?}"), &one, &bf16(2, layout), 0.02);
    }
}

#[test]
fn cp_combines_with_pipelines_zero_and_recomputation() {
    let layouts: [(usize, &[&str]); 4] = [
        (4, &["--cp", "2", "--pp", "2", "--micro-batches", "2"]),
        (4, &["--cp", "2", "--dp", "2", "--zero", "1"]),
        (4, &argv("--cp 2 --dp 2 --zero 3 --recompute full")),
        (2, &["--cp", "2", "--recompute", "selective"]),
    ];
    agree(&argv(LLAMA), "16", &layouts);
    agree(&argv(GPT), "16", &layouts[..1]);
}

/// The `step peak host N B` of rank 0's memory line.
fn step_peak(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.split("step peak host ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no memory line in {text}"))
}

#[test]
fn a_cp4_ranks_step_peak_is_at_most_0_4_of_one_ranks_at_seq_2048() {
    let args = argv(
        "--layers 2 --width 64 --heads 4 --seq-len 2048 --batch-size 2 --steps 2 --gen-tokens 0",
    );
    let one = step_peak(&ok(launch(1, &args)));
    let mut cp4 = args.to_vec();
    cp4.extend_from_slice(&["--cp", "4"]);
    let four = step_peak(&ok(launch(4, &cp4)));
    let ratio = four as f64 / one as f64;
    eprintln!("step peak: one rank {one} B, a CP4 rank {four} B, ratio {ratio:.3}");
    assert!(ratio <= 0.4, "a CP4 rank peaks at {ratio:.3} of one rank");
}

/// The `generated ids: a,b,c` lines of a run's output, in order.
fn generated_ids(text: &str) -> Vec<String> {
    let ids: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_once("generated ids: ").map(|(_, i)| i.to_string()))
        .collect();
    assert!(!ids.is_empty(), "no generated ids in: {text}");
    ids
}

#[test]
fn generation_with_the_cache_split_over_cp_gives_one_ranks_ids() {
    let dir = common::scratch_dir("cp_train", "generation");
    for (model, name) in [(LLAMA, "llama"), (GPT, "gpt")] {
        let ckpt = dir.join(name);
        let cs = ckpt.to_str().unwrap();
        let mut train = argv(model);
        train.extend(argv(
            "--seq-len 16 --batch-size 4 --steps 3 --seed 3 --dtype f64 --gen-tokens 0",
        ));
        train.extend(["--save", cs]);
        ok(launch(1, &train));
        // Two prompts of 5 tokens (padded to whole chunks under --cp) and one of 3 as a second
        // batch; 14 tokens run 3 of them past the 16 positions (each from the last window).
        for sampling in [
            &["--temperature", "0"][..],
            &["--temperature", "0.9", "--top-k", "5"],
        ] {
            let generate = |n: usize, layout: &[&str]| {
                let mut args = vec!["--resume", cs, "--seed", "3"];
                args.extend(["--prompt-ids", "5,17,3,9,2;4,4,8,1,30;7,3,11"]);
                args.extend(["--gen-tokens", "14"]);
                args.extend_from_slice(sampling);
                args.extend_from_slice(layout);
                generated_ids(&ok(launch(n, &args)))
            };
            let one = generate(1, &[]);
            assert_eq!(one.len(), 3, "{one:?}");
            let layouts: [(usize, &[&str]); 4] = [
                (2, &["--cp", "2"]),
                (4, &["--cp", "4"]),
                (4, &["--cp", "2", "--tp", "2"]),
                (4, &["--cp", "2", "--dp", "2"]),
            ];
            for (n, layout) in layouts {
                assert_eq!(generate(n, layout), one, "{name} {sampling:?} {layout:?}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
