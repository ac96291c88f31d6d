//! Pipelines on GPUs: on 2 GPU ranks (NCCL world, one process per GPU), `train --device cuda`
//! gives the CPU backend's loss curve (f32, 30 steps, at most 1e-5 relative) for PP2 under
//! GPipe, 1F1B and interleaved 1F1B, PP2 with ZeRO-1 and full recomputation, and DP2 and TP2;
//! and a device world that cannot run — NCCL missing, a pipeline's two stages on one GPU, a
//! mesh of more ranks than GPUs — fails on every rank with the same typed error at rendezvous,
//! before any NCCL call. Without 2 GPUs the GPU cases print "skipped: ..."; the NCCL-missing
//! case runs wherever NCCL is missing.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{argv, binaries, curve, max_rel, stdout_or_tail, GPU_GPT};
use oxiflow::collectives::cuda_libs::{self, LibSearch};
use oxiflow::collectives::rendezvous::{generate_token, StoreServer};

/// The suites' GPT for 30 steps of every layout, in f32 on both backends (the device default
/// is bf16-mixed).
const STEPS: [&str; 2] = ["--steps", "30"];

/// The visible GPUs, or why there are none.
fn gpus() -> Result<usize, String> {
    cuda_libs::probe(&LibSearch::default()).nccl_ready()
}

/// Rank 0's loss curve of a 2-rank `train` job, or what went wrong.
fn train(backend: &str, device: &str, layout: &[&str]) -> Result<Vec<(u64, f64)>, String> {
    let (oflaunch, train) = binaries();
    let out = Command::new(oflaunch)
        .args(["--nproc-per-node", "2", "--backend", backend])
        .arg(train)
        .args(GPU_GPT)
        .args(STEPS)
        .args(["--device", device, "--precision", "f32"])
        .args(layout)
        .env("NCCL_NVLS_ENABLE", "0")
        .output();
    Ok(curve(&stdout_or_tail(out, &format!("{backend} run"))?))
}

#[test]
fn pipelines_and_other_layouts_on_two_gpus_give_the_cpu_curves() {
    match gpus() {
        Ok(n) if n >= 2 => {}
        Ok(n) => return eprintln!("gpu_pipeline: skipped: needs 2 GPUs, {n} visible"),
        Err(why) => return eprintln!("gpu_pipeline: skipped: no CUDA ({why})"),
    }
    let layouts: [(&str, &[&str]); 6] = [
        (
            "PP2 GPipe",
            &["--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"],
        ),
        (
            "PP2 1F1B",
            &["--pp", "2", "--micro-batches", "4", "--schedule", "1f1b"],
        ),
        (
            "PP2 interleaved",
            &argv("--pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2"),
        ),
        (
            "PP2 1F1B ZeRO-1 recompute",
            &argv("--pp 2 --micro-batches 4 --zero 1 --recompute full"),
        ),
        ("DP2", &["--dp", "2"]),
        ("TP2", &["--tp", "2"]),
    ];
    // Every layout runs (and is reported) before any verdict.
    let mut failures = Vec::new();
    for (name, layout) in layouts {
        let t = Instant::now();
        let result = train("nccl", "cuda", layout).and_then(|gpu| {
            let cpu = train("cpu", "cpu", layout)?;
            if gpu.len() != 30 || cpu.len() != 30 {
                return Err(format!(
                    "{} and {} loss lines, not 30",
                    gpu.len(),
                    cpu.len()
                ));
            }
            Ok((max_rel(&gpu, &cpu), gpu[0].1, gpu[29].1))
        });
        match result {
            Ok((rel, first, last)) => {
                println!(
                    "gpu_pipeline: {name}: 30 steps, loss {first:.6} -> {last:.6}, max relative difference cuda vs cpu {rel:.2e} ({:.1?})",
                    t.elapsed()
                );
                if rel > 1e-5 {
                    failures.push(format!("{name}: curves differ by {rel:.2e} relative"));
                }
            }
            Err(e) => {
                println!("gpu_pipeline: {name}: FAILED: {e}");
                failures.push(format!("{name}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Starts `train ARGS` as ranks `0..world` of an NCCL world on one host, rank r on CUDA device
/// `device(r)`, with a store of its own (no launcher: every rank's own error is seen).
fn ranks(world: usize, device: impl Fn(usize) -> usize, args: &[&str]) -> Vec<Child> {
    let token = generate_token().expect("token");
    let server =
        StoreServer::bind("127.0.0.1:0".parse().expect("addr"), token.clone()).expect("store");
    let addr = server.local_addr();
    // The store lives as long as the test process (the ranks end within its timeout).
    std::mem::forget(server);
    (0..world)
        .map(|r| {
            Command::new(&binaries().1)
                .args(GPU_GPT)
                .args(STEPS)
                .args(args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", addr.ip().to_string())
                .env("MASTER_PORT", addr.port().to_string())
                .env("OXIFLOW_TOKEN", &token)
                .env("OXIFLOW_BACKEND", "nccl")
                .env("OXIFLOW_DEVICE", device(r).to_string())
                .env("OXIFLOW_TIMEOUT", "60")
                .env("NCCL_NVLS_ENABLE", "0")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn rank")
        })
        .collect()
}

/// Every rank fails within a few seconds, its error containing each of `want`.
fn all_fail_alike(kids: Vec<Child>, want: &[&str]) {
    let t = Instant::now();
    for (r, kid) in kids.into_iter().enumerate() {
        let out = kid.wait_with_output().expect("wait");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "rank {r} succeeded");
        for w in want {
            assert!(err.contains(w), "rank {r}: no {w:?} in:\n{err}");
        }
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        println!("gpu_pipeline: rank {r} refused: {last}");
    }
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "the ranks took {:?} to fail",
        t.elapsed()
    );
}

#[test]
fn a_device_world_without_nccl_is_refused_on_every_rank() {
    let why = match gpus() {
        Ok(_) => return eprintln!("gpu_pipeline nccl missing: skipped: NCCL is here"),
        Err(why) => why,
    };
    let kids = ranks(2, |r| r, &["--pp", "2", "--device", "cuda"]);
    all_fail_alike(
        kids,
        &["rendezvous join", "cannot join: NCCL is unavailable", &why],
    );
}

#[test]
fn stages_on_one_gpu_and_meshes_larger_than_the_gpus_are_refused_on_every_rank() {
    let n = match gpus() {
        Ok(n) if n >= 2 => n,
        Ok(n) => return eprintln!("gpu_pipeline one gpu: skipped: needs 2 GPUs, {n} visible"),
        Err(why) => return eprintln!("gpu_pipeline one gpu: skipped: no CUDA ({why})"),
    };
    // PP2 with both stages bound to GPU 0.
    let kids = ranks(2, |_| 0, &["--pp", "2", "--device", "cuda"]);
    all_fail_alike(kids, &["both use CUDA device 0", "one GPU per rank"]);
    // A [pp 2, dp 2] mesh of 4 ranks on 2 GPUs (bound round-robin, as oflaunch does).
    let kids = ranks(
        2 * n,
        |r| r % n,
        &["--pp", "2", "--dp", "2", "--device", "cuda"],
    );
    all_fail_alike(kids, &["both use CUDA device", "one GPU per rank"]);
    // A rank bound to a GPU that is not there.
    let kids = ranks(2, |r| r * n, &["--pp", "2", "--device", "cuda"]);
    all_fail_alike(kids, &["device(s) are visible", "one GPU per rank"]);
}
