//! The trainer's features under `oflaunch` with real processes (CPU/TCP backend): a cosine
//! schedule with warm-up, clipping at a norm the run reaches, gradient accumulation and dropout
//! keep one rank's full-batch curve, learning rates and gradient norms in every layout (1 rank
//! accumulating, DP4, TP4, DP2xTP2 with SP, PP2xDP2 with ZeRO-3; f64, 1e-9); `--metrics`,
//! `--plot`, checkpoint lines and the configuration saved beside a checkpoint (a job file that
//! runs); job files with command-line overrides; token shards in both formats, per-rank
//! sampling and a mid-shard resume; `train prepare` with GPT-2's BPE; `--resume auto`.

mod common;

use std::path::{Path, PathBuf};

use common::{argv, assert_close, curve, launch, max_rel, ok, succeed_in};
use serde_json::Value;

const TINY: [&str; 14] = common::TINY_GPT;

fn tmp(name: &str) -> PathBuf {
    common::scratch_dir("trainer", name)
}

fn tiny(nproc: usize, args: &[&str]) -> String {
    let mut all = TINY.to_vec();
    all.extend_from_slice(args);
    ok(launch(nproc, &all))
}

/// The records of a metrics file.
fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// (step, loss, lr, grad-norm) of the training records.
fn train_records(recs: &[Value]) -> Vec<(u64, f64, f64, f64)> {
    recs.iter()
        .filter(|r| r["kind"] == "train")
        .map(|r| {
            let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
            (
                r["step"].as_u64().unwrap(),
                f("loss"),
                f("lr"),
                f("grad_norm"),
            )
        })
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// Runs the tiny GPT with the new features on `nproc` ranks with `layout`, returning its
/// training records.
fn featured(dir: &Path, name: &str, nproc: usize, layout: &[&str]) -> Vec<(u64, f64, f64, f64)> {
    let m = dir.join(format!("{name}.jsonl"));
    let mut args = vec![
        "--steps",
        "10",
        "--seed",
        "3",
        "--dtype",
        "f64",
        "--lr",
        "0.01",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "3",
        "--min-lr",
        "0.001",
        "--dropout",
        "0.1",
        "--metrics",
        m.to_str().unwrap(),
    ];
    args.extend_from_slice(layout);
    tiny(nproc, &args);
    train_records(&records(&m))
}

#[test]
fn schedules_clipping_and_accumulation_keep_the_one_rank_curve_in_every_layout() {
    let dir = tmp("features");
    const CLIP: &str = "1.3";
    let clip: f64 = CLIP.parse().unwrap();
    let one = featured(&dir, "one", 1, &["--clip-grad", CLIP]);
    assert_eq!(one.len(), 10);
    let clipped = one.iter().filter(|r| r.3 > clip).count();
    assert!(
        clipped > 0 && clipped < one.len(),
        "the run reaches the clipping norm on some steps: {one:?}"
    );
    assert!(
        one[9].1 < one[0].1 - 1.0,
        "training makes progress: {one:?}"
    );
    // Warm-up to 0.01 over 3 steps, then the cosine down towards 0.001.
    assert!((one[0].2 - 0.01 / 3.0).abs() < 1e-15 && (one[2].2 - 0.01).abs() < 1e-15);
    assert!(one[9].2 < one[5].2 && one[9].2 > 0.001);
    let unclipped = featured(&dir, "unclipped", 1, &[]);
    assert!(
        rel(unclipped[9].1, one[9].1) > 1e-6,
        "clipping changes the curve"
    );
    let layouts: [(usize, &[&str]); 6] = [
        (1, &["--grad-accum", "2"]),
        (4, &["--dp", "4", "--grad-accum", "2"]),
        (4, &["--tp", "4", "--grad-accum", "2"]),
        (4, &["--dp", "2", "--tp", "2", "--sp", "--grad-accum", "2"]),
        (
            4,
            &argv("--pp 2 --dp 2 --zero 3 --micro-batches 2 --grad-accum 2"),
        ),
        (4, &argv("--pp 2 --tp 2 --micro-batches 2 --grad-accum 2")),
    ];
    for (i, (n, layout)) in layouts.iter().enumerate() {
        let mut args = vec!["--clip-grad", CLIP];
        args.extend_from_slice(layout);
        let got = featured(&dir, &format!("layout{i}"), *n, &args);
        assert_eq!(got.len(), one.len(), "{layout:?}");
        let mut worst = (0.0f64, 0.0f64, 0.0f64);
        for (a, b) in got.iter().zip(&one) {
            assert_eq!(a.0, b.0);
            worst = (
                worst.0.max(rel(a.1, b.1)),
                worst.1.max(rel(a.2, b.2)),
                worst.2.max(rel(a.3, b.3)),
            );
        }
        eprintln!(
            "{layout:?}: max relative difference loss {:.1e} lr {:.1e} grad-norm {:.1e}",
            worst.0, worst.1, worst.2
        );
        assert!(
            worst.0 <= 1e-9 && worst.1 <= 1e-12 && worst.2 <= 1e-9,
            "{layout:?} differs: {worst:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn metrics_plots_checkpoint_lines_and_the_saved_configuration() {
    let dir = tmp("outputs");
    let (m, png, svg, ck) = (
        dir.join("m.jsonl"),
        dir.join("loss.png"),
        dir.join("loss.svg"),
        dir.join("ckpt"),
    );
    let ps = |p: &PathBuf| p.to_str().unwrap().to_string();
    let args = [
        "--steps",
        "20",
        "--log-every",
        "5",
        "--eval-every",
        "10",
        "--peak-tflops",
        "1",
        "--metrics",
        &ps(&m),
        "--plot",
        &ps(&png),
        "--save",
        &ps(&ck),
        "--save-every",
        "10",
    ];
    let mut all = TINY.to_vec();
    all.truncate(12);
    all.extend_from_slice(&args);
    let out = ok(launch(2, &all));
    let recs = records(&m);
    let train = train_records(&recs);
    assert_eq!(
        train.iter().map(|r| r.0).collect::<Vec<_>>(),
        [5, 10, 15, 20],
        "one record per logged step"
    );
    let printed = curve(&out);
    for (r, (n, l)) in train.iter().zip(&printed) {
        assert_eq!(r.0, *n);
        assert!(rel(r.1, *l) < 1e-7, "{r:?} vs {n} {l}");
    }
    for r in recs.iter().filter(|r| r["kind"] == "train") {
        for key in argv("step loss lr grad_norm tokens_per_s mfu seconds") {
            assert!(r[key].is_number(), "{key} in {r}");
        }
        for key in argv("parameters gradients optimizer_state host_peak device_peak") {
            assert!(r["memory"][key].is_number(), "memory.{key} in {r}");
        }
        assert!(r["mfu"].as_f64().unwrap() > 0.0);
    }
    let evals: Vec<u64> = recs
        .iter()
        .filter(|r| r["kind"] == "eval")
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [10, 20], "{recs:?}");
    let bytes = std::fs::read(&png).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 10_000,
        "{} bytes",
        bytes.len()
    );
    for want in [
        "checkpoint step 10 saved to",
        "checkpoint step 20 saved to",
        "metrics: ",
        "plot: ",
    ] {
        assert!(out.contains(want), "{want}: {out}");
    }
    // The configuration beside the checkpoint is a job file: it reruns the job (the last 10
    // steps from the checkpoint, here with an SVG plot) with the same losses.
    let conf = dir.join("ckpt.config.toml");
    let text = std::fs::read_to_string(&conf).unwrap();
    assert!(
        text.contains("[optim]") && text.contains("steps = 20"),
        "{text}"
    );
    // A copy: the saved job file is an input of the rerun, which saves (and writes its
    // configuration) beside the same checkpoint.
    let job = dir.join("job.toml");
    std::fs::copy(&conf, &job).unwrap();
    let rerun = ok(launch(
        2,
        &[
            "--config",
            &ps(&job),
            "--resume",
            &ps(&ck),
            "--steps",
            "25",
            "--plot",
            &ps(&svg),
            "--metrics",
            &ps(&dir.join("m2.jsonl")),
        ],
    ));
    let again = curve(&rerun);
    assert_eq!(again.first().map(|c| c.0), Some(25), "{rerun}");
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg_text.contains("<svg") && svg_text.contains("polyline"),
        "{svg_text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_job_file_sets_flags_and_the_command_line_overrides_it() {
    let dir = tmp("jobfile");
    let job = dir.join("job.toml");
    std::fs::write(
        &job,
        "[model]\nlayers = 2\nwidth = 32\nheads = 4\nseq-len = 16\nseed = 7\ndtype = \"f64\"\n\
         [data]\nbatch-size = 8\n[optim]\nlr = 0.02\nlr-schedule = \"linear\"\nwarmup-steps = 2\n\
         [run]\nsteps = 50\nlog-every = 1\n[generate]\ngen-tokens = 0\n",
    )
    .unwrap();
    let j = job.to_str().unwrap();
    let from_file = ok(launch(2, &["--config", j, "--steps", "6", "--lr", "0.01"]));
    assert!(
        from_file.contains(
            "config [optim] optimizer=\"adamw\" lr=0.01 lr-schedule=\"linear\" warmup-steps=2"
        ),
        "{from_file}"
    );
    let flags = tiny(
        2,
        &argv("--seed 7 --dtype f64 --lr 0.01 --lr-schedule linear --warmup-steps 2 --steps 6"),
    );
    let diff = max_rel(&curve(&from_file), &curve(&flags));
    assert!(
        diff <= 1e-12,
        "the job file and the flags differ by {diff:e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The test's own shard writers: llm.c's header spelled out, or nanoGPT's raw ids.
fn write_shard(path: &Path, llmc: bool, ids: &[u16]) {
    let mut bytes = Vec::new();
    if llmc {
        let mut header = [0i32; 256];
        header[..3].copy_from_slice(&[20240520, 1, ids.len() as i32]);
        bytes.extend(header.iter().flat_map(|h| h.to_le_bytes()));
    }
    bytes.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn token_shards_train_alike_in_both_formats_and_resume_mid_shard() {
    let dir = tmp("shards");
    // Four shards of 1000 byte-level ids (62 windows of 17 each; 223 train, 25 held out).
    let text = oxiflow::data::generated_text(1, 4000);
    for (i, chunk) in text.as_bytes().chunks(1000).take(4).enumerate() {
        let ids: Vec<u16> = chunk.iter().map(|&b| u16::from(b)).collect();
        write_shard(&dir.join(format!("llmc_{i}.bin")), true, &ids);
        write_shard(&dir.join(format!("raw_{i}.bin")), false, &ids);
    }
    let llmc = dir.join("llmc_*.bin");
    let raw = dir.join("raw_*.bin");
    let base = ["--seed", "2", "--dtype", "f64", "--data"];
    let with = |data: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        a.push(data.to_str().unwrap().into());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |n: usize, a: Vec<String>| {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        tiny(n, &refs)
    };
    // 40 steps of 8 windows run through the 223 training windows once and on.
    let full = run(1, with(&llmc, &["--steps", "40"]));
    assert!(full.contains("4 llmc (u16 ids) shards"), "{full}");
    let full = curve(&full);
    assert_eq!(full.len(), 40);
    let from_raw = curve(&run(2, with(&raw, &["--steps", "40", "--dp", "2"])));
    assert_close("raw DP2", &full, &from_raw, 1e-12);
    // Saved under DP2 at step 20 (window 160: inside the third shard), resumed on one rank.
    let ck = dir.join("ckpt");
    let cs = ck.to_str().unwrap();
    run(
        2,
        with(&llmc, &["--steps", "20", "--dp", "2", "--save", cs]),
    );
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("manifest.json")).unwrap()).unwrap();
    let meta = &manifest["metadata"];
    assert_eq!(meta["data.windows"], "160", "{meta}");
    let at = meta["data.position"].as_str().unwrap();
    assert!(at.contains("llmc_2.bin id 576 epoch 0"), "{at}");
    // Every tensor's saved layout names the axes of the mesh it was saved on.
    for (name, t) in manifest["tensors"].as_object().unwrap() {
        assert_eq!(
            t["layout"]["axes"],
            serde_json::json!(["dp", "tp"]),
            "{name}"
        );
    }
    let resumed = curve(&run(1, with(&llmc, &["--steps", "40", "--resume", cs])));
    assert_eq!(resumed.first().map(|c| c.0), Some(21));
    assert_close("the resumed curve", &full[20..], &resumed, 1e-12);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn prepare_writes_gpt2_shards_that_train() {
    let dir = tmp("prepare");
    let (_, train) = common::binaries();
    let mut inputs: Vec<PathBuf> = std::fs::read_dir("/usr/share/common-licenses")
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    inputs.sort();
    inputs.truncate(3);
    if inputs.is_empty() {
        let p = dir.join("generated.txt");
        std::fs::write(&p, oxiflow::data::generated_text(0, 100_000)).unwrap();
        inputs.push(p);
    }
    let prefix = dir.join("lic");
    let out = std::process::Command::new(train)
        .args([
            "prepare",
            "--out",
            prefix.to_str().unwrap(),
            "--shard-tokens",
            "4000",
            "--tokenizer",
            "gpt2",
        ])
        .args(&inputs)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(
            "tokens of tokenizer gpt2 (vocabulary 50257; each document after <|endoftext|>"
        ) && text.contains("llmc shards of u16 ids"),
        "{text}"
    );
    let glob = format!("{}_*.bin", prefix.display());
    let mut args = TINY[..10].to_vec();
    args.extend_from_slice(&["--tokenizer", "gpt2", "--data", &glob, "--steps", "3"]);
    args.extend_from_slice(&["--log-every", "1", "--gen-tokens", "4"]);
    let run = ok(launch(2, &args));
    assert!(
        run.contains("vocab 50257") && run.contains("tokenizer gpt2"),
        "{run}"
    );
    assert_eq!(curve(&run).len(), 3);
    assert!(run.contains("sample (temperature"), "{run}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_auto_starts_fresh_continues_and_says_when_the_job_is_done() {
    let dir = tmp("resume-auto");
    let (_, train) = common::binaries();
    let ck = dir.join("ck");
    let ck = ck.to_str().unwrap();
    let run = |steps: &str| {
        let mut args = argv("--model mlp --log-every 1 --resume auto --save");
        args.extend([ck, "--steps", steps]);
        succeed_in(train, &dir, &args)
    };
    let first = run("3");
    assert!(first.contains("from step 0"), "{first}");
    let more = run("5");
    assert!(more.contains("from step 3"), "{more}");
    assert_eq!(curve(&more).first().map(|c| c.0), Some(4));
    let done = run("5");
    assert!(
        done.contains("is at step 5, which reaches --steps 5: nothing to train")
            && curve(&done).is_empty(),
        "{done}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
