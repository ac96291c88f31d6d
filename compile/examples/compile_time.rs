//! Compile time against depth, on the CPU: the README's GPT (4 heads, width 64, 64-token
//! windows, batch 16, f32) at 12, 24 and 48 layers on 1 rank, one training step (forward,
//! backward, SGD with momentum). Per depth it prints the eager step's time, the compilation's
//! (capture, which runs the step eagerly once under the recorder, plus the passes), the
//! capture's cost above the eager step, the passes alone (dead-code elimination, liveness, the
//! arena plan, timed again on a copy of the captured program), the counts, and the per-layer
//! figures, which stay flat when compile time is linear in depth. The arena plan is the one
//! pass above linear: greedy by size, each buffer scans the buffers placed before it.
//!
//! `cargo run --release -p oxiflow-compile --example compile_time`

#[path = "../tests/common/sgd_step.rs"]
mod sgd_step;

use std::time::{Duration, Instant};

use oxiflow_compile::passes::{arena::plan_arena, dce::eliminate_dead_code, liveness::liveness};
use oxiflow_compile::{CompiledStep, StepRun};
use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout};
use oxiflow_models::nn::{Module, Parameter};
use oxiflow_tensor::Tensor;
use sgd_step::{momentum_sgd, sgd_step};

const BATCH: usize = 16;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn depth(layers: usize) -> oxiflow_compile::Result<()> {
    let cfg = GptConfig {
        layers,
        dtype: DType::F32,
        ..GptConfig::default()
    };
    let model = Gpt::new(&cfg, &GptLayout::Local)?;
    let params: Vec<Parameter> = model.parameters();
    let mut opt = momentum_sgd(params.clone(), 0.01, 0.0);
    let n = BATCH * cfg.seq_len;
    let ids = Tensor::from_vec(
        (0..n).map(|i| (i * 31 % cfg.vocab) as i64).collect(),
        [BATCH, cfg.seq_len],
    )?;
    let targets = Tensor::from_vec(
        (0..n).map(|i| ((i + 1) * 31 % cfg.vocab) as i64).collect(),
        [BATCH, cfg.seq_len],
    )?;
    let mut body = || sgd_step(&model, &mut opt, &params, &ids, &targets, false);
    // Two eager steps (the first creates the momentum and warms the caches); the second timed.
    body()?;
    let t = Instant::now();
    body()?;
    let eager = t.elapsed();
    let mut inputs = vec![ids.clone(), targets.clone()];
    inputs.extend(params.iter().map(Parameter::value));
    let mut compiled = CompiledStep::new();
    let (_, run) = compiled.run(&inputs, &mut body)?;
    let StepRun::Compiled(c) = run else {
        return Err(oxiflow_compile::CompileError::Inputs {
            detail: "the first call did not compile".into(),
        });
    };
    let mut program = c.program.clone();
    let t = Instant::now();
    eliminate_dead_code(&mut program);
    let t_dce = t.elapsed();
    let live = liveness(&program);
    let t_live = t.elapsed();
    let plan = plan_arena(&live);
    let passes = t.elapsed();
    let total = c.report.compile_time;
    let capture_cost = total.saturating_sub(eager);
    println!(
        "{layers:>2} layers: eager step {:6.1} ms | compile {:6.1} ms (capture cost above the eager step {:5.1} ms; passes {:5.2} ms: dce {:.2}, liveness {:.2}, arena plan {:.2}) | {} ops -> {} kernels, arena {} bytes | per layer: compile {:5.2} ms, capture cost {:5.2} ms, passes {:5.3} ms",
        ms(eager),
        ms(total),
        ms(capture_cost),
        ms(passes),
        ms(t_dce),
        ms(t_live - t_dce),
        ms(passes - t_live),
        c.report.ops,
        c.report.kernels,
        plan.bytes,
        ms(total) / layers as f64,
        ms(capture_cost) / layers as f64,
        ms(passes) / layers as f64,
    );
    Ok(())
}

fn main() {
    for layers in [12, 24, 48] {
        if let Err(e) = depth(layers) {
            eprintln!("{layers} layers: {e}");
            std::process::exit(1);
        }
    }
}
