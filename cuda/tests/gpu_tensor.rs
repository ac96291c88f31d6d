//! GPU suite of the CUDA tensor backend: on 1, 2 and 4 GPU ranks (as many as are visible) (one process per GPU, NCCL world
//! from `init_from_env`, real rendezvous store), (a) proptest-generated global ops on cuda
//! placements compared with the same ops on local CPU tensors (f32 tolerance), including
//! autograd, the indexed and masking ops and vocabulary parallelism, and (b) boxing between random (placement, nd-SBP) pairs of cuda placements
//! (exact), (c) pipelined boxing: 30 iterations of boxing chains (1-d, and a [2, 2] mesh on 4
//! ranks) queued with no synchronisation, results kept alive or dropped, then compared with
//! the same chains on CPU; (d) every bf16/f16 kernel against f64 on random, never-zero data;
//! (e) the vocabulary-parallel cross-entropy kernels against the CPU ones; (f) the generated
//! fused element-wise kernels against f64 in f32, bf16 and f16; (g) the fused linear
//! cross-entropy against f64;
//! plus the device Philox generator against `rng::philox4x32_10`.
//! Prints "skipped: no CUDA (...)" where there is no GPU.
//!
//! A custom harness (`harness = false`): the parent re-runs this binary once per rank.

use std::process::Command;
use std::time::{Duration, Instant};

use oxiflow_collectives::cuda_libs::{self, LibSearch};
use oxiflow_collectives::env::one_host_launch_vars;
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};
use oxiflow_cuda::{self as cuda, init_from_env};
use oxiflow_ops::adamw::{
    adam_moment, adam_update, adamw_multi, adamw_multi_clipped, adamw_multi_guarded, AdamWHyper,
    AdamWSlot,
};
use oxiflow_ops::linear::Activation;
use oxiflow_ops::residual_layer_norm::residual_layer_norm;
use oxiflow_tensor::{DType, DeviceType, NdSbp, Placement, Result, Sbp, Shape, Tensor, UnaryOp};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

// The tensor crate's test helpers and 16-bit cases, shared with its CPU suites.
#[path = "../../tensor/tests/common/mod.rs"]
mod common;
mod gpu_tensor_checks;
// Waiting for the rank processes, shared with the NCCL suite.
#[path = "../../collectives/tests/rank_processes/mod.rs"]
mod rank_processes;
use rank_processes::{gpu_cases, ranks_failed};
#[path = "../../tensor/tests/half_cases/mod.rs"]
mod half_cases;
use gpu_tensor_checks::{
    child_adamw_copies, child_adamw_reuse, child_buckets, child_fused_elementwise,
    child_linear_classifier, child_residual_mlp, child_shared_input, child_vocab_parallel,
};
use gpu_tensor_checks::{
    child_bf16, child_creation, child_flash, child_half, child_inputs_unchanged,
    child_large_reductions, child_pipelined, op_strategy, run_case, sbp_of,
};

fn close(a: &[f64], b: &[f64]) -> std::result::Result<(), String> {
    close_to(a, b, 2e-4)
}

/// Whether the device's values `a` equal the reference `b` within `tol * (1 + |b|)` each (NaN
/// where the reference is NaN); the first difference otherwise.
fn close_to(a: &[f64], b: &[f64], tol: f64) -> std::result::Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("lengths {} vs {}", a.len(), b.len()));
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let ok = (x - y).abs() <= tol * (1.0 + y.abs()) || (x.is_nan() && y.is_nan());
        if !ok {
            return Err(format!("element {i}: device {x} vs reference {y}"));
        }
    }
    Ok(())
}

/// The first `n` of `failures`, each on an indented line of its own.
/// What a check returns: the number of cases it checked, or why it failed.
type Checked = std::result::Result<usize, String>;

/// A check on a world of the given size on a device type that counts its cases.
type CaseCounter = dyn Fn(usize, DeviceType) -> Checked;

fn first_failures(failures: &[String], n: usize) -> String {
    failures[..failures.len().min(n)].join("\n  ")
}

/// An error unless `got` and `want` (of `what`, holding `items`) are equally long.
fn same_len<T, U>(
    what: &str,
    items: &str,
    got: &[T],
    want: &[U],
) -> std::result::Result<(), String> {
    if got.len() == want.len() {
        return Ok(());
    }
    Err(format!(
        "{what}: {} {items}, want {}",
        got.len(),
        want.len()
    ))
}

/// `checked` when `failures` is empty; else an error saying which cases failed (`summary`)
/// with the first `n` failures.
fn passed_or_first(checked: usize, failures: &[String], summary: String, n: usize) -> Checked {
    if failures.is_empty() {
        Ok(checked)
    } else {
        Err(format!(
            "{summary} failed; first:\n  {}",
            first_failures(failures, n)
        ))
    }
}

fn values(t: &Tensor) -> Result<Vec<f64>> {
    t.cast(DType::F64)?.to_vec::<f64>()
}

fn child_ops(world: usize, cases: u32, dev: DeviceType) -> Checked {
    let placement =
        Placement::new_1d(dev, (0..world).collect::<Vec<_>>()).map_err(|e| e.to_string())?;
    let local = |shape: &[usize], seed: u64, _s: usize| -> Result<Tensor> {
        Ok(Tensor::randn(Shape::from(shape), seed, DType::F32))
    };
    let global = |shape: &[usize], seed: u64, s: usize| -> Result<Tensor> {
        Tensor::randn_global(
            Shape::from(shape),
            seed,
            DType::F32,
            &placement,
            NdSbp::new([sbp_of(s, shape.len())]),
        )
    };
    let mut runner = TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
    );
    let strat = op_strategy();
    let mut done = 0;
    // Keep going after a failing case (every rank runs the same cases, so collectives stay
    // matched) and report the first few failures.
    let mut failures: Vec<String> = Vec::new();
    for i in 0..cases {
        let case = strat
            .new_tree(&mut runner)
            .map_err(|e| e.to_string())?
            .current();
        let want = run_case(&case, &local).map_err(|e| format!("case {i} {case:?} cpu: {e}"))?;
        let got = match run_case(&case, &global) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("case {i} {case:?} gpu: {e}"));
                continue;
            }
        };
        if got.len() != want.len() {
            failures.push(format!(
                "case {i} {case:?}: {} outputs vs {}",
                got.len(),
                want.len()
            ));
            continue;
        }
        let mut ok = true;
        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
            let check = || -> std::result::Result<(), String> {
                if g.shape() != w.shape() {
                    return Err(format!("shape {} vs {}", g.shape(), w.shape()));
                }
                if g.placement().is_some_and(|p| p.device() != dev) {
                    return Err(format!("left the {dev} placement"));
                }
                let gv = values(g).map_err(|e| e.to_string())?;
                let wv = values(w).map_err(|e| e.to_string())?;
                close(&gv, &wv)
            };
            if let Err(e) = check() {
                failures.push(format!(
                    "case {i} {case:?} output {j} ({}): {e}",
                    g.describe()
                ));
                ok = false;
            }
        }
        done += ok as usize;
    }
    passed_or_first(
        done,
        &failures,
        format!("{} of {cases} op cases", cases as usize - done),
        6,
    )
}

#[derive(Clone, Debug)]
struct BoxCase {
    dims: Vec<usize>,
    dtype: usize,
    from_pl: usize,
    to_pl: usize,
    from: Vec<usize>,
    to: Vec<usize>,
    seed: u64,
}

fn box_strategy() -> impl Strategy<Value = BoxCase> {
    (
        prop::collection::vec(1..13usize, 1..4),
        0..3usize,
        0..3usize,
        0..3usize,
        prop::collection::vec(0..5usize, 2),
        prop::collection::vec(0..5usize, 2),
        0..1000u64,
    )
        .prop_map(|(dims, dtype, from_pl, to_pl, from, to, seed)| BoxCase {
            dims,
            dtype,
            from_pl,
            to_pl,
            from,
            to,
            seed,
        })
}

fn placements(world: usize, dev: DeviceType) -> Vec<Placement> {
    let all: Vec<usize> = (0..world).collect();
    let mut v = vec![Placement::new_1d(dev, all.clone()).expect("1-d")];
    if world == 1 {
        return v;
    }
    if world == 4 {
        v.push(
            Placement::new_1d(dev, all)
                .expect("p")
                .reshaped([2, 2])
                .expect("2-d"),
        );
        v.push(Placement::new_1d(dev, vec![3, 1]).expect("sub"));
    } else {
        v.push(Placement::new_1d(dev, vec![1, 0]).expect("rev"));
    }
    v
}

/// Per mesh axis: 0..3 split of dim (i mod ndim), 3 B, 4 P.
fn nd(codes: &[usize], p: &Placement, ndim: usize, dtype: DType) -> NdSbp {
    NdSbp::new((0..p.ndim()).map(|a| match codes[a] {
        3 => Sbp::B,
        4 if dtype != DType::I64 => Sbp::P,
        4 => Sbp::B,
        i => Sbp::S(i % ndim),
    }))
}

fn child_boxing(world: usize, rank: usize, cases: u32, dev: DeviceType) -> Checked {
    let pls = placements(world, dev);
    let mut failures: Vec<String> = Vec::new();
    let mut runner = TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[9; 32]),
    );
    let strat = box_strategy();
    let mut done = 0;
    for i in 0..cases {
        let c = strat
            .new_tree(&mut runner)
            .map_err(|e| e.to_string())?
            .current();
        let dtype = [DType::F32, DType::F64, DType::I64][c.dtype];
        let (pf, pt) = (&pls[c.from_pl % pls.len()], &pls[c.to_pl % pls.len()]);
        let shape = Shape::from(c.dims.as_slice());
        let (sf, st) = (
            nd(&c.from, pf, c.dims.len(), dtype),
            nd(&c.to, pt, c.dims.len(), dtype),
        );
        let mk = |t: Tensor| -> Result<Tensor> { t.mul_scalar(100.0)?.cast(dtype) };
        let want = values(
            &mk(Tensor::randn(shape.clone(), c.seed, DType::F32)).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
        let run = || -> Result<Option<Vec<f64>>> {
            let b = mk(Tensor::randn_global(
                shape.clone(),
                c.seed,
                DType::F32,
                pf,
                NdSbp::broadcast(pf.ndim()),
            )?)?;
            let x = b.to_global(pf, sf.clone())?;
            let y = x.to_global(pt, st.clone())?;
            if !pt.contains(rank) {
                return Ok(None);
            }
            Ok(Some(values(&y)?))
        };
        match run() {
            Err(e) => failures.push(format!("box case {i} {c:?} ({pf} {sf} -> {pt} {st}): {e}")),
            Ok(Some(g)) if g != want => {
                let bad = g.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                failures.push(format!(
                    "box case {i} {c:?} ({pf} {sf} -> {pt} {st}): element {bad} of {}: {:?} vs {:?}",
                    want.len(),
                    g.get(bad),
                    want.get(bad)
                ))
            }
            Ok(_) => done += 1,
        }
    }
    passed_or_first(
        done,
        &failures,
        format!("{} of {cases} boxing cases", failures.len()),
        6,
    )
}

/// One rank's checks: rank 0 prints a line per check that passed; a failing check prints the
/// rank's error and sets the process's exit code to the check's.
struct Checks {
    world: usize,
    rank: usize,
    code: i32,
}

impl Checks {
    fn report<T>(
        &mut self,
        code: i32,
        what: &str,
        result: std::result::Result<T, String>,
        line: impl FnOnce(T) -> String,
    ) {
        match result {
            Ok(v) if self.rank == 0 => println!("gpu_tensor: world {}: {}", self.world, line(v)),
            Ok(_) => {}
            Err(e) => {
                eprintln!("rank {}: {what}: {e}", self.rank);
                self.code = code;
            }
        }
    }
}

fn child(world: usize, rank: usize, cases: u32) -> i32 {
    let ctx = match init_from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rank {rank}: init_from_env: {e}");
            return 2;
        }
    };
    if rank == 0 {
        println!(
            "gpu_tensor: world {world}: backend {:?}, cuda:{}",
            ctx.world().backend(),
            cuda::bound_runtime().map_or(usize::MAX, |r| r.ordinal())
        );
    }
    let t = Instant::now();
    let mut code = 0;
    if rank == 0 {
        // Device Philox against the host reference.
        match cuda::philox_words_device(0x1234_5678_9abc, (1 << 32) - 3, 1000) {
            Ok(w) => {
                let bad = (0..1000u64).find(|&i| {
                    let idx = (1u64 << 32) - 3 + i;
                    w[i as usize]
                        != oxiflow_tensor::rng::philox4x32_10(
                            [idx as u32, (idx >> 32) as u32, 0, 0],
                            [0x5678_9abc, 0x1234],
                        )
                });
                if let Some(i) = bad {
                    eprintln!("philox: word {i} differs from the host generator");
                    code = 3;
                } else {
                    println!("gpu_tensor: philox 1000 blocks equal to rng::philox4x32_10");
                }
            }
            Err(e) => {
                eprintln!("philox: {e}");
                code = 3;
            }
        }
    }
    let mut checks = Checks { world, rank, code };
    let cuda = DeviceType::Cuda;
    checks.report(4, "ops", child_ops(world, cases, cuda), |n| {
        format!("{n} op cases equal to CPU ({:.1?})", t.elapsed())
    });
    let t = Instant::now();
    checks.report(5, "boxing", child_boxing(world, rank, cases, cuda), |n| {
        format!("{n} boxing cases exact ({:.1?})", t.elapsed())
    });
    checks.report(6, "pipelined boxing", child_pipelined(world, cuda), |(n, k, ms)| {
        format!("pipelined boxing: {n} iterations ({k} kept) equal to CPU ({ms:.1}ms queued + synchronized)")
    });
    checks.report(9, "bf16 matmul", child_bf16(world), |gap| {
        format!("bf16 matmul equals the bf16-rounded product (f32 accumulation), {gap:.1e} from the f32 one")
    });
    checks.report(8, "device creation", child_creation(world), |n| {
        format!("{n} creation cases made on the device equal the host's (randn within 1 f32 / 4 f64 ulp)")
    });
    // The checks that count their cases: (exit code, name, check, what the cases showed).
    let counted: [(i32, &str, &CaseCounter, &str); 10] = [
        (10, "16-bit kernels", &child_half, "bf16/f16 kernel cases within their rounding of the f64 reference"),
        (12, "large sums", &child_large_reductions, "large sums (several passes) within 2e-4 of the f64 sums"),
        (14, "AdamW copies", &child_adamw_copies, "AdamW compute copies bit for bit the casts of the new values"),
        (15, "gradient and parameter buckets", &move |w: usize, d: DeviceType| child_buckets(w, rank, d), "bucket pieces (gradients all-reduced and reduce-scattered: f32, f64, bf16 wire; shards all-gathered: f32, bf16, bit for bit) equal each tensor boxed alone, read and used after the other pieces were dropped"),
        (16, "vocabulary-parallel cross-entropy", &child_vocab_parallel, "vocabulary-parallel cross-entropy cases (f32, bf16, f16, f64; lse, loss, dlogits, padded classifier) equal to the CPU kernels, padding gradient 0"),
        (17, "fused element-wise kernels", &child_fused_elementwise, "generated fused element-wise kernel cases (f32, bf16, f16; bias rows, strided and scalar broadcasts, backward steps, casts) within their roundings of the f64 unfused ops, bit-equal on a second launch"),
        (18, "fused linear cross-entropy", &child_linear_classifier, "fused linear cross-entropy cases (f32, bf16, f16, f64; loss, dx, dw; padding; several chunks) within their rounding of the f64 reference"),
        (19, "fused MLP", &child_residual_mlp, "fused MLP cases (f32, bf16, f16, f64; y and six gradients; GPT-2 widths; GELU's output kept or computed again) within their rounding of the unfused f64 layers"),
        (20, "shared inputs", &child_shared_input, "shared-input cases (f32, bf16, f16, f64; three linears' and a LayerNorm's input gradients summed in their kernels) within their rounding of the f64 graph"),
        (21, "AdamW over its own memory", &child_adamw_reuse, "AdamW results written over their slots' own memory bit for bit the update into new memory (f32 with bf16/f16 copies, f64; clipped by a device ratio and a host factor); holders of a device piece counted"),
    ];
    for (code, what, check, showed) in counted {
        checks.report(code, what, check(world, cuda), |n| format!("{n} {showed}"));
    }
    let t = Instant::now();
    checks.report(11, "fused attention", child_flash(world, cuda), |n| {
        format!("{n} fused attention runs (bf16, f16, f32; o, lse, dq, dk, dv) within tolerance of the f64 reference ({:.1?})", t.elapsed())
    });
    checks.report(
        7,
        "inputs unchanged",
        child_inputs_unchanged(world, rank, cuda),
        |()| {
            "P->B x5 then P->S leave the P input unchanged; results equal the host sum".to_string()
        },
    );
    let code = checks.code;
    if rank == 0 {
        if let Some(rt) = cuda::bound_runtime() {
            println!(
                "gpu_tensor: allocator caches {} MiB",
                rt.cached_bytes() >> 20
            );
        }
    }
    code
}

/// Without GPUs: the same case generators on a CPU placement (4 in-process ranks) against the
/// local reference, so the suite's cases themselves stay valid where CI runs.
fn cpu_self_check() {
    let res = oxiflow_tensor::run_ranks(4, Duration::from_secs(120), |rank| {
        child_ops(4, 16, DeviceType::Cpu)
            .and_then(|a| child_boxing(4, rank, 16, DeviceType::Cpu).map(|b| (a, b)))
            .and_then(|ab| child_pipelined(4, DeviceType::Cpu).map(|(_, p, _)| (ab, p)))
            .and_then(|abp| child_inputs_unchanged(4, rank, DeviceType::Cpu).map(|_| abp))
            .and_then(|abp| child_half(4, DeviceType::Cpu).map(|h| (abp, h)))
            .and_then(|abph| child_flash(4, DeviceType::Cpu).map(|f| (abph, f)))
            .and_then(|x| child_large_reductions(4, DeviceType::Cpu).map(|_| x))
            .and_then(|x| child_adamw_copies(4, DeviceType::Cpu).map(|_| x))
            .and_then(|x| child_buckets(4, rank, DeviceType::Cpu).map(|_| x))
            .and_then(|x| child_vocab_parallel(4, DeviceType::Cpu).map(|_| x))
            .and_then(|x| child_fused_elementwise(4, DeviceType::Cpu).map(|_| x))
            .and_then(|x| child_linear_classifier(4, DeviceType::Cpu).map(|_| x))
            .and_then(|x| child_residual_mlp(4, DeviceType::Cpu).map(|_| x))
            .and_then(|x| child_shared_input(4, DeviceType::Cpu).map(|_| x))
            .and_then(|x| child_adamw_reuse(4, DeviceType::Cpu).map(|_| x))
    });
    for (rank, r) in res.iter().enumerate() {
        if let Err(e) = r {
            panic!("cpu self-check rank {rank}: {e}");
        }
    }
    println!(
        "gpu_tensor: cpu self-check of the case generators: {:?}",
        res[0]
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() >= 5 && args[1] == "child" {
        let (rank, world, cases) = (
            args[2].parse().unwrap_or(0),
            args[3].parse().unwrap_or(0),
            args[4].parse().unwrap_or(0),
        );
        std::process::exit(child(world, rank, cases));
    }
    let ndev = match cuda_libs::probe(&LibSearch::default()).nccl_ready() {
        Ok(n) => n,
        Err(reason) => {
            println!("gpu_tensor: skipped: no CUDA ({reason})");
            cpu_self_check();
            return;
        }
    };
    if ndev < 1 {
        println!("gpu_tensor: skipped: no CUDA (no GPU visible)");
        return;
    }
    let cases = gpu_cases(40);
    let exe = std::env::current_exe().expect("current_exe");
    let mut failed = Vec::new();
    for world in [1usize, 2, 4] {
        if world > ndev {
            println!(
                "gpu_tensor: world {world}: skipped: no CUDA (needs {world} GPUs, {ndev} visible)"
            );
            continue;
        }
        // A fresh store per world: NCCL's id exchange keys are per job, so a second world on
        // the same store could read the first world's stale unique id.
        let token = generate_token().expect("token");
        let server =
            StoreServer::bind("127.0.0.1:0".parse().expect("addr"), token.clone()).expect("store");
        let addr = server.local_addr();
        let spawn = || {
            (0..world)
                .map(|r| {
                    Command::new(&exe)
                        .args([
                            "child",
                            &r.to_string(),
                            &world.to_string(),
                            &cases.to_string(),
                        ])
                        .envs(one_host_launch_vars(r, world, addr, &token))
                        .env("OXIFLOW_BACKEND", "nccl")
                        .env("OXIFLOW_TIMEOUT", "30")
                        .env("NCCL_NVLS_ENABLE", "0")
                        .spawn()
                        .expect("spawn rank")
                })
                .collect()
        };
        let what = format!("gpu_tensor: world {world}");
        if ranks_failed(&what, spawn, Duration::from_secs(300)).is_some() {
            failed.push(world);
        }
    }
    if !failed.is_empty() {
        println!("gpu_tensor: FAILED in worlds {failed:?}");
        std::process::exit(1);
    }
    println!("gpu_tensor: all GPU scenarios passed");
}
