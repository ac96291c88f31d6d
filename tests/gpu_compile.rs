//! The compiled step on GPUs (NCCL world, one process per GPU): `train --device cuda
//! --compile` replays each step from its planned arena on the device (one block per program and
//! rank, every buffer a view at its offset, kernels writing into them, boxing results copied
//! in) and gives the eager loss curve: f32, 12 steps, at most 1e-5 relative, on 1 GPU, and on 2
//! GPUs with DP2 (buckets), TP2, a PP2 1F1B pipeline, ZeRO-2 (parameters all-gathered by the
//! update, outside the program) and ZeRO-3; bf16-mixed (cuDNN's fused attention, computed
//! provisionally under the capture) within bf16 rounding on 1 GPU and with ZeRO-2; the replays
//! from the second step on launching one CUDA graph per rank (the job says so), except
//! ZeRO-2's, which run launch by launch and say why; traced (`oflaunch --trace`), DP2 replays
//! launch by launch and says so. Rank 0's memory line gives the bytes the driver counts in use,
//! at least the step's peak of its own blocks. Without GPUs it prints "skipped: ...".

mod common;

use std::process::Command;

use common::{binaries, curve, max_rel, stdout_or_tail, GPU_GPT};
use oxiflow::collectives::cuda_libs::{self, LibSearch};

/// The suites' GPT for 12 steps.
const STEPS: [&str; 2] = ["--steps", "12"];

/// Rank 0's output of an `n`-GPU `train` job, or what went wrong.
fn train(n: usize, args: &[&str]) -> Result<String, String> {
    train_launched(n, &[], args)
}

/// [`train`] with more `oflaunch` flags (`launch`).
fn train_launched(n: usize, launch: &[&str], args: &[&str]) -> Result<String, String> {
    let (oflaunch, train) = binaries();
    let out = Command::new(oflaunch)
        .args(["--nproc-per-node", &n.to_string(), "--backend", "nccl"])
        .args(launch)
        .arg(train)
        .args(GPU_GPT)
        .args(STEPS)
        .args(["--device", "cuda"])
        .args(args)
        .env("NCCL_NVLS_ENABLE", "0")
        .output();
    stdout_or_tail(out, &format!("{args:?}"))
}

/// (the step's device peak, the bytes the driver counts in use) of rank 0's memory line.
fn device_memory(out: &str) -> Option<(u64, u64)> {
    let line = out.lines().find(|l| l.contains("memory rank 0"))?;
    let number = |text: &str| text.split_whitespace().next()?.parse().ok();
    let peak = number(
        line.split("step peak host ")
            .nth(1)?
            .split(" device ")
            .nth(1)?,
    )?;
    let used = number(line.split("device in use ").nth(1)?)?;
    Some((peak, used))
}

#[test]
fn compiled_steps_on_gpus_equal_eager() {
    let gpus = match cuda_libs::probe(&LibSearch::default()).nccl_ready() {
        Ok(n) => n,
        Err(why) => return eprintln!("gpu_compile: skipped: no CUDA ({why})"),
    };
    // (GPUs, flags, largest relative difference allowed): f32 at 1e-5; bf16-mixed, whose
    // capture computes the fused attention provisionally while cuDNN builds its plans (the
    // compile's first replay gives step 1), within bf16 rounding (cuDNN's backward
    // accumulates dQ with atomics, so no two runs agree bit for bit).
    const F32: f64 = 1e-5;
    const BF16: f64 = 1e-2;
    let mut layouts: Vec<(usize, &[&str], f64)> = vec![
        (1, &["--precision", "f32"], F32),
        (1, &["--precision", "bf16-mixed"], BF16),
    ];
    if gpus >= 2 {
        layouts.extend([
            (
                2,
                &["--precision", "f32", "--dp", "2", "--bucket-mb", "0.05"][..],
                F32,
            ),
            (2, &["--precision", "f32", "--tp", "2"][..], F32),
            (
                2,
                &["--precision", "f32", "--pp", "2", "--micro-batches", "2"][..],
                F32,
            ),
            (
                2,
                &["--precision", "f32", "--dp", "2", "--zero", "2"][..],
                F32,
            ),
            (
                2,
                &["--precision", "f32", "--dp", "2", "--zero", "3"][..],
                F32,
            ),
            (
                2,
                &["--precision", "bf16-mixed", "--dp", "2", "--zero", "2"][..],
                BF16,
            ),
        ]);
    } else {
        eprintln!("gpu_compile: the 2-GPU layouts skipped: {gpus} GPU visible");
    }
    let mut failures = Vec::new();
    for (n, layout, tolerance) in layouts {
        let result = train(n, layout).and_then(|eager| {
            // The driver's count of the device in use holds at least the step's own blocks.
            match device_memory(&eager) {
                Some((peak, used)) if used >= peak && peak > 0 => {}
                other => {
                    return Err(format!(
                        "the memory line's (step peak, device in use): {other:?}"
                    ))
                }
            }
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
                if rel > tolerance {
                    failures.push(format!("{layout:?}: compiled differs by {rel:.2e}"));
                }
                // ZeRO-2's leaves come from all-gathers queued after each step: its replays
                // run launch by launch, each op waiting for its own (a graph would wait for
                // all before its first kernel). Every other layout launches one CUDA graph
                // from the second step on, its capture and instantiation counted in the
                // compile time it reports.
                if layout.windows(2).any(|w| w == ["--zero", "2"]) {
                    if !how.contains("launch by launch")
                        || !how.contains("written by a collective before each step")
                    {
                        failures.push(format!("{layout:?}: not launch by launch: {how}"));
                    }
                } else if !how.contains("one device graph") {
                    failures.push(format!("{layout:?}: no CUDA graph: {how}"));
                } else if !(how.contains("captured and instantiated in")
                    && how.contains("compile time with it"))
                {
                    failures.push(format!("{layout:?}: no graph build time: {how}"));
                }
            }
            Err(e) => {
                println!("gpu_compile: {n} GPU {layout:?}: FAILED: {e}");
                failures.push(e);
            }
        }
    }
    if gpus >= 2 {
        // Traced, a program that communicates replays launch by launch and says why (the
        // trace times each op: the device refuses a capture before queuing anything).
        let dir = std::env::temp_dir().join(format!("gpu_compile_trace_{}", std::process::id()));
        let traced = train_launched(
            2,
            &["--trace", &dir.to_string_lossy()],
            &["--precision", "f32", "--dp", "2", "--compile"],
        );
        let _ = std::fs::remove_dir_all(&dir);
        match traced {
            Ok(out) if out.contains("replays launch by launch") => {
                println!("gpu_compile: 2 GPU traced DP2: replays launch by launch");
            }
            Ok(out) => failures.push(format!(
                "traced DP2 does not say it replays launch by launch: {}",
                out.lines()
                    .filter(|l| l.contains("compiled"))
                    .collect::<Vec<_>>()
                    .join(" | ")
            )),
            Err(e) => failures.push(format!("traced DP2: {e}")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
