//! The compiled step on GPUs (NCCL world, one process per GPU): `train --device cuda
//! --compile` replays each step from its planned arena on the device (one block per program and
//! rank, every buffer a view at its offset, kernels writing into them, boxing results copied
//! in) and gives the eager loss curve: f32, 12 steps, at most 1e-5 relative, on 1 GPU, and on 2
//! GPUs with DP2 (buckets), TP2, a PP2 1F1B pipeline, ZeRO-2 (parameters all-gathered by the
//! update, outside the graph) and ZeRO-3, the replays from the third step on
//! launching one CUDA graph per rank (the job says so). Without GPUs it prints "skipped: ...".

mod common;

use std::process::Command;

use common::{binaries, curve, max_rel, GPU_GPT};
use oxiflow::collectives::cuda_libs::{self, LibSearch};

/// The suites' GPT for 12 steps.
const STEPS: [&str; 2] = ["--steps", "12"];

/// Rank 0's output of an `n`-GPU `train` job, or what went wrong.
fn train(n: usize, args: &[&str]) -> Result<String, String> {
    let (oflaunch, train) = binaries();
    let out = Command::new(oflaunch)
        .args(["--nproc-per-node", &n.to_string(), "--backend", "nccl"])
        .arg(train)
        .args(GPU_GPT)
        .args(STEPS)
        .args(["--device", "cuda", "--precision", "f32"])
        .args(args)
        .env("NCCL_NVLS_ENABLE", "0")
        .output()
        .map_err(|e| format!("oflaunch: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(12).collect();
        return Err(format!(
            "{args:?} failed ({}): {}",
            out.status,
            tail.join(" | ")
        ));
    }
    Ok(text)
}

#[test]
fn compiled_steps_on_gpus_equal_eager() {
    let gpus = match cuda_libs::probe(&LibSearch::default()).nccl_ready() {
        Ok(n) => n,
        Err(why) => return eprintln!("gpu_compile: skipped: no CUDA ({why})"),
    };
    let mut layouts: Vec<(usize, &[&str])> = vec![(1, &[])];
    if gpus >= 2 {
        layouts.extend([
            (2, &["--dp", "2", "--bucket-mb", "0.05"][..]),
            (2, &["--tp", "2"][..]),
            (2, &["--pp", "2", "--micro-batches", "2"][..]),
            (2, &["--dp", "2", "--zero", "2"][..]),
            (2, &["--dp", "2", "--zero", "3"][..]),
        ]);
    } else {
        eprintln!("gpu_compile: the 2-GPU layouts skipped: {gpus} GPU visible");
    }
    let mut failures = Vec::new();
    for (n, layout) in layouts {
        let result = train(n, layout).and_then(|eager| {
            let mut args = layout.to_vec();
            args.push("--compile");
            let compiled = train(n, &args)?;
            let (a, b) = (curve(&eager), curve(&compiled));
            if a.len() != 12 || b.len() != 12 {
                return Err(format!("{} and {} loss lines, not 12", a.len(), b.len()));
            }
            let find = |what: &str| {
                compiled
                    .lines()
                    .find(|l| l.contains(what))
                    .map_or_else(|| format!("no line with {what:?}"), str::to_string)
            };
            Ok((
                max_rel(&a, &b),
                find("compiled: "),
                find("compiled step: replays"),
            ))
        });
        match result {
            Ok((rel, line, how)) => {
                println!(
                    "gpu_compile: {n} GPU {layout:?}: max relative difference {rel:.2e}; {line}; {how}"
                );
                if rel > 1e-5 {
                    failures.push(format!("{layout:?}: compiled differs by {rel:.2e}"));
                }
                // From the third step on every replay launches one CUDA graph.
                if !how.contains("one device graph") {
                    failures.push(format!("{layout:?}: no CUDA graph: {how}"));
                }
            }
            Err(e) => {
                println!("gpu_compile: {n} GPU {layout:?}: FAILED: {e}");
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
