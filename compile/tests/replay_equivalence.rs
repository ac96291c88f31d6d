//! Compiled equals eager: a small GPT trained with SGD (momentum) for a few steps, each step
//! (forward, backward, update) run through a `CompiledStep` (captured on the first call,
//! compiled again when the optimizer's state appears, replayed after), gives the eager loss
//! curve and parameters on 1 rank, DP2, TP2, DP2 x TP2 with sequence parallelism and ZeRO-3
//! with full recomputation (in-process ranks, f64: 1e-9 relative; one f32 case: 1e-5).

mod common;

use std::time::Duration;

use common::sgd_step::{momentum_sgd, sgd_step};
use common::small_gpt;
use oxiflow_compile::{CompiledStep, StepRun};
use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout, Recompute};
use oxiflow_models::nn::{Module, Parameter};
use oxiflow_models::optim::{Optimizer, Zero};
use oxiflow_placement::{DeviceType, NamedMesh, Placement, DP, TP};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{run_ranks, Tensor};

const STEPS: usize = 5;
const BATCH: usize = 4;
const SEQ: usize = 8;

#[derive(Clone, Copy, Debug)]
struct Case {
    dp: usize,
    tp: usize,
    sp: bool,
    zero3: bool,
    recompute: bool,
    dtype: DType,
}

const ONE: Case = Case {
    dp: 1,
    tp: 1,
    sp: false,
    zero3: false,
    recompute: false,
    dtype: DType::F64,
};

fn config(case: Case) -> GptConfig {
    small_gpt(SEQ, case.dtype, case.sp)
}

/// The batch of `step` (ids and next-token targets), whole on every rank, then laid out as
/// the model takes it.
fn batch(step: usize, placement: Option<&Placement>) -> (Tensor, Tensor) {
    let tok = |i: usize| ((i * 7 + step * 5 + i / 3) % 32) as i64;
    let ids: Vec<i64> = (0..BATCH * SEQ).map(tok).collect();
    let targets: Vec<i64> = (0..BATCH * SEQ).map(|i| tok(i + 1)).collect();
    let whole = |v: Vec<i64>| Tensor::from_vec(v, [BATCH, SEQ]).unwrap();
    match placement {
        None => (whole(ids), whole(targets)),
        Some(p) => {
            let lay = |t: Tensor| {
                t.to_global(p, NdSbp::broadcast(2))
                    .unwrap()
                    .to_global(p, NdSbp::new([Sbp::S(0), Sbp::B]))
                    .unwrap()
            };
            (lay(whole(ids)), lay(whole(targets)))
        }
    }
}

struct Run {
    losses: Vec<f64>,
    params: Vec<Vec<f64>>,
    compiled: usize,
    replayed: usize,
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

fn train(case: Case, compiled: bool, rank: usize) -> Run {
    let ranks = case.dp * case.tp;
    let placement = (ranks > 1 || case.zero3).then(|| {
        Placement::new(
            DeviceType::Cpu,
            [case.dp, case.tp],
            (0..ranks).collect::<Vec<_>>(),
        )
        .unwrap()
    });
    let mesh = placement
        .as_ref()
        .map(|p| NamedMesh::of(p.clone(), &[DP, TP]).unwrap());
    let layout = match &mesh {
        Some(m) => GptLayout::Mesh(m.clone()),
        None => GptLayout::Local,
    };
    let mut model = Gpt::new(&config(case), &layout).unwrap();
    if case.recompute {
        model.recompute = Recompute::Full;
    }
    let params: Vec<Parameter> = model.parameters();
    let mut opt = momentum_sgd(params.clone(), 0.05, 0.01);
    if let (true, Some(m)) = (case.zero3, &mesh) {
        opt = opt.with_zero(Zero::over(3, m).unwrap()).unwrap();
    }
    let mut step_fn = CompiledStep::new();
    let (mut losses, mut n_compiled, mut n_replayed) = (Vec::new(), 0, 0);
    for step in 0..STEPS {
        let (ids, targets) = batch(step, placement.as_ref());
        let states: Vec<Tensor> = (0..params.len())
            .filter_map(|i| opt.state(i, "momentum_buffer"))
            .collect();
        let mut inputs = vec![ids.clone(), targets.clone()];
        inputs.extend(params.iter().map(Parameter::value));
        inputs.extend(states.iter().cloned());
        let mut body = || sgd_step(&model, &mut opt, &params, &ids, &targets, true);
        let outs: Vec<Tensor> = if compiled {
            let (outs, run) = step_fn.run(&inputs, &mut body).unwrap();
            match run {
                StepRun::Compiled(c) => {
                    n_compiled += 1;
                    let r = &c.report;
                    assert!(r.kernels > 0 && r.arena_bytes > 0, "{r}");
                    if n_compiled > 1 {
                        let why = r.recompiled_because.clone().unwrap_or_default();
                        assert!(why.contains("inputs instead of"), "{why}");
                    }
                }
                StepRun::Replayed => n_replayed += 1,
            }
            outs
        } else {
            body().unwrap()
        };
        for (p, v) in params.iter().zip(&outs[1..]) {
            p.set_value(v).unwrap();
        }
        for (i, s) in outs[1 + params.len()..].iter().enumerate() {
            opt.set_state(i, "momentum_buffer", s.clone()).unwrap();
        }
        opt.set_step_count(step as u64 + 1);
        losses.push(values(&outs[0])[0]);
    }
    let params = params.iter().map(|p| values(&p.value())).collect();
    let _ = rank;
    Run {
        losses,
        params,
        compiled: n_compiled,
        replayed: n_replayed,
    }
}

fn check(case: Case) {
    let ranks = case.dp * case.tp;
    let run = |compiled: bool| {
        run_ranks(ranks, Duration::from_secs(60), |rank| {
            train(case, compiled, rank)
        })
    };
    let eager = run(false);
    let compiled = run(true);
    let tol = if case.dtype == DType::F64 { 1e-9 } else { 1e-5 };
    for (e, c) in eager.iter().zip(&compiled) {
        assert_eq!(
            c.compiled, 2,
            "{case:?}: compiled on step 1 and when the state appeared"
        );
        assert_eq!(c.replayed, STEPS - 2, "{case:?}");
        for (s, (a, b)) in e.losses.iter().zip(&c.losses).enumerate() {
            assert!(
                (a - b).abs() <= tol * a.abs().max(1e-30),
                "{case:?} step {s}: eager loss {a}, compiled {b}"
            );
        }
        for (pa, pb) in e.params.iter().zip(&c.params) {
            for (a, b) in pa.iter().zip(pb) {
                assert!(
                    (a - b).abs() <= tol * a.abs().max(1.0),
                    "{case:?}: parameter {a} vs {b}"
                );
            }
        }
    }
    // The loss moved and every step's differs (a replay of stale values would not match).
    let l = &eager[0].losses;
    assert!(l[STEPS - 1] < l[0], "{case:?}: losses {l:?}");
    for (i, a) in l.iter().enumerate() {
        assert!(
            l[i + 1..].iter().all(|b| (a - b).abs() > 1e-6),
            "{case:?}: losses {l:?}"
        );
    }
}

#[test]
fn one_rank_compiled_equals_eager() {
    check(ONE);
}

#[test]
fn one_rank_f32_compiled_equals_eager() {
    check(Case {
        dtype: DType::F32,
        ..ONE
    });
}

#[test]
fn dp2_compiled_equals_eager() {
    check(Case { dp: 2, ..ONE });
}

#[test]
fn tp2_compiled_equals_eager() {
    check(Case { tp: 2, ..ONE });
}

#[test]
fn dp2_tp2_sequence_parallel_compiled_equals_eager() {
    check(Case {
        dp: 2,
        tp: 2,
        sp: true,
        ..ONE
    });
}

#[test]
fn zero3_recompute_compiled_equals_eager() {
    check(Case {
        dp: 2,
        zero3: true,
        recompute: true,
        ..ONE
    });
}
