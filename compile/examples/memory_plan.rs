//! Memory planning alone, on the CPU: the README's GPT (2 layers, 4 heads, width 64, 64-token
//! windows, batch 16, f32, SGD with momentum) on 1 rank, DP2, TP2 and DP2 with ZeRO-3, the
//! ranks as threads of this process. Per layout it prints each rank's planned arena (and the
//! lower bound: the most bytes live at one node), the sum over ranks, and the process's
//! measured host peak above what was live before the step, for an eager step and for the first
//! replay of the compiled step (which allocates the planned arena) and a later one (which runs in
//! it: what it allocates is its copied-out outputs and kernel scratch).
//!
//! `cargo run --release -p oxiflow-compile --example memory_plan`

#[path = "../tests/common/sgd_step.rs"]
mod sgd_step;

use std::sync::{Barrier, Mutex};
use std::time::Duration;

use oxiflow_compile::{CompiledStep, StepRun};
use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout};
use oxiflow_models::nn::{Module, Parameter};
use oxiflow_models::optim::{Optimizer, Zero};
use oxiflow_placement::{DeviceType, NamedMesh, Placement, DP, TP};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::memory::{self, CountingAllocator};
use oxiflow_tensor::{run_ranks, Tensor};
use sgd_step::{momentum_sgd, sgd_step};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const BATCH: usize = 16;

struct Layout {
    name: &'static str,
    dp: usize,
    tp: usize,
    zero3: bool,
}

/// What one rank saw.
struct RankPlan {
    arena: usize,
    lower_bound: usize,
    persistent: usize,
    line: String,
}

fn batch(step: usize, cfg: &GptConfig, placement: Option<&Placement>) -> (Tensor, Tensor) {
    let n = BATCH * cfg.seq_len;
    let tok = |i: usize| ((i * 31 + step * 17 + i / 7) % cfg.vocab) as i64;
    let make = |off: usize| {
        Tensor::from_vec(
            (0..n).map(|i| tok(i + off)).collect::<Vec<_>>(),
            [BATCH, cfg.seq_len],
        )
    };
    let (ids, targets) = (make(0).ok(), make(1).ok());
    let (Some(ids), Some(targets)) = (ids, targets) else {
        panic!("batch of {n} tokens")
    };
    match placement {
        None => (ids, targets),
        Some(p) => {
            let lay = |t: Tensor| {
                t.to_global(p, NdSbp::broadcast(2))
                    .and_then(|t| t.to_global(p, NdSbp::new([Sbp::S(0), Sbp::B])))
                    .unwrap_or_else(|e| panic!("{e}"))
            };
            (lay(ids), lay(targets))
        }
    }
}

fn run_layout(l: &Layout) -> oxiflow_compile::Result<()> {
    let ranks = l.dp * l.tp;
    let cfg = GptConfig {
        dtype: DType::F32,
        ..GptConfig::default()
    };
    let barrier = Barrier::new(ranks);
    let peaks: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let measure = |rank: usize, f: &mut dyn FnMut()| {
        barrier.wait();
        let before = memory::host().map_or(0, |m| m.live);
        if rank == 0 {
            memory::reset_peaks();
        }
        barrier.wait();
        f();
        barrier.wait();
        if rank == 0 {
            let peak = memory::host().map_or(0, |m| m.peak);
            peaks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(peak.saturating_sub(before));
        }
        barrier.wait();
    };
    let plans = run_ranks(
        ranks,
        Duration::from_secs(120),
        |rank| -> oxiflow_compile::Result<RankPlan> {
            let placement = (ranks > 1).then(|| {
                Placement::new(
                    DeviceType::Cpu,
                    [l.dp, l.tp],
                    (0..ranks).collect::<Vec<_>>(),
                )
                .unwrap_or_else(|e| panic!("{e}"))
            });
            let mesh = placement
                .clone()
                .map(|p| NamedMesh::of(p, &[DP, TP]).unwrap_or_else(|e| panic!("{e}")));
            let layout = mesh.clone().map_or(GptLayout::Local, GptLayout::Mesh);
            let model = Gpt::new(&cfg, &layout)?;
            let params: Vec<Parameter> = model.parameters();
            let mut opt = momentum_sgd(params.clone(), 0.01, 0.0);
            if let (true, Some(m)) = (l.zero3, &mesh) {
                opt = opt.with_zero(Zero::over(3, m)?)?;
            }
            let mut compiled = CompiledStep::new();
            let mut report = None;
            for step in 0..5 {
                let (ids, targets) = batch(step, &cfg, placement.as_ref());
                let mut inputs = vec![ids.clone(), targets.clone()];
                inputs.extend(params.iter().map(Parameter::value));
                inputs.extend((0..params.len()).filter_map(|i| opt.state(i, "momentum_buffer")));
                let mut body = || sgd_step(&model, &mut opt, &params, &ids, &targets, true);
                let mut result = None;
                match step {
                    // Step 0 creates the momentum; step 1 is the measured eager step.
                    0 => result = Some(body()),
                    1 => measure(rank, &mut || result = Some(body())),
                    // Step 2 compiles; steps 3 (the first replay) and 4 are measured.
                    2 => {
                        let r = compiled.run(&inputs, &mut body);
                        if let Ok((_, StepRun::Compiled(c))) = &r {
                            report = Some(c.clone());
                        }
                        result = Some(r.map(|(o, _)| o));
                    }
                    _ => measure(rank, &mut || {
                        result = Some(compiled.run(&inputs, &mut body).map(|(o, _)| o))
                    }),
                }
                let outs = result.unwrap_or_else(|| Ok(Vec::new()))?;
                for (p, v) in params.iter().zip(&outs[1..]) {
                    p.set_value(v)?;
                }
                for (i, s) in outs[1 + params.len()..].iter().enumerate() {
                    opt.set_state(i, "momentum_buffer", s.clone())?;
                }
            }
            let Some(c) = report else {
                return Err(oxiflow_compile::CompileError::Inputs {
                    detail: "step 2 did not compile".into(),
                });
            };
            if let Some(conflict) = c.arena.first_conflict() {
                return Err(oxiflow_compile::CompileError::Inputs { detail: conflict });
            }
            Ok(RankPlan {
                arena: c.arena.bytes,
                lower_bound: c.live.peak_live_bytes,
                persistent: c.report.external_bytes,
                line: format!("  rank {rank}: {}", c.report),
            })
        },
    );
    let plans: Vec<RankPlan> = plans.into_iter().collect::<oxiflow_compile::Result<_>>()?;
    let peaks = peaks.into_inner().unwrap_or_else(|e| e.into_inner());
    println!(
        "{} ({ranks} rank{}):",
        l.name,
        if ranks > 1 { "s" } else { "" }
    );
    for (rank, p) in plans.iter().enumerate() {
        println!(
            "  rank {rank}: planned arena {} bytes (lower bound {}), inputs and constants {} bytes",
            p.arena, p.lower_bound, p.persistent
        );
        println!("{}", p.line);
    }
    let arena: usize = plans.iter().map(|p| p.arena).sum();
    println!(
        "  all ranks: planned arenas {arena} bytes; measured step peak above live: eager {} bytes, first replay {} bytes (allocates the arenas), later replay {} bytes (in the arenas)",
        peaks.first().copied().unwrap_or(0),
        peaks.get(1).copied().unwrap_or(0),
        peaks.get(2).copied().unwrap_or(0)
    );
    Ok(())
}

fn main() {
    let layouts = [
        Layout {
            name: "1 rank",
            dp: 1,
            tp: 1,
            zero3: false,
        },
        Layout {
            name: "DP2",
            dp: 2,
            tp: 1,
            zero3: false,
        },
        Layout {
            name: "TP2",
            dp: 1,
            tp: 2,
            zero3: false,
        },
        Layout {
            name: "DP2 ZeRO-3",
            dp: 2,
            tp: 1,
            zero3: true,
        },
    ];
    for l in &layouts {
        if let Err(e) = run_layout(l) {
            eprintln!("{}: {e}", l.name);
            std::process::exit(1);
        }
    }
}
