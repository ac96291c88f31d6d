//! The passes on the CPU: dead-code elimination removes what no output reads and keeps every
//! communicating boxing; liveness and the arena plan never give two buffers live at one node
//! the same bytes, and reuse dead ones (property-tested on random lifetimes and on captured
//! programs); a step that reads a value on the host is a typed error naming the read on every
//! rank, without a hang; a step called with other shapes compiles again, naming the change;
//! element views are recorded at their offsets.

mod common;

use std::time::Duration;

use common::{compile_first, split_row};
use oxiflow_compile::ir::ValueId;
use oxiflow_compile::passes::arena::{plan_arena, ARENA_ALIGN};
use oxiflow_compile::passes::liveness::{BufferLife, Liveness};
use oxiflow_compile::{CompileError, CompiledStep, StepRun};
use oxiflow_dtype::DType;
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{run_ranks, Tensor};
use proptest::prelude::*;

fn lives(spec: &[(usize, usize, usize)]) -> Liveness {
    Liveness {
        buffers: spec
            .iter()
            .enumerate()
            .map(|(i, &(bytes, def, len))| BufferLife {
                buffer: ValueId(i as u32),
                bytes,
                def,
                last: def + len,
            })
            .collect(),
        release_after: Vec::new(),
        peak_live_bytes: 0,
    }
}

proptest! {
    #[test]
    fn arena_plans_never_overlap_live_buffers(
        spec in proptest::collection::vec((0usize..5000, 0usize..40, 0usize..10), 0..60)
    ) {
        let live = lives(&spec);
        let plan = plan_arena(&live);
        prop_assert_eq!(plan.first_conflict(), None);
        prop_assert_eq!(plan.placed.len(), spec.len());
        // At least the most bytes live at one node, at most everything side by side.
        let most_live = (0..50)
            .map(|t| live.buffers.iter().filter(|b| b.def <= t && t <= b.last).map(|b| b.bytes).sum::<usize>())
            .max()
            .unwrap_or(0);
        let side_by_side: usize = spec.iter().map(|s| s.0.div_ceil(ARENA_ALIGN) * ARENA_ALIGN).sum();
        prop_assert!(plan.bytes >= most_live);
        prop_assert!(plan.bytes <= side_by_side);
    }
}

#[test]
fn arena_reuses_dead_buffers() {
    // A chain: each buffer dies when the next is written.
    let chain: Vec<(usize, usize, usize)> = (0..10).map(|i| (1000, i, 1)).collect();
    let plan = plan_arena(&lives(&chain));
    assert_eq!(plan.first_conflict(), None);
    assert_eq!(
        plan.bytes,
        2 * 1024,
        "two buffers live at once, each 1024 aligned"
    );
}

/// A local step with a dead branch: `x.exp()` that nothing returns.
#[test]
fn dead_code_is_removed_and_replay_equals_eager() {
    let mut step = CompiledStep::new();
    let f = |x: &Tensor| -> oxiflow_compile::Result<Vec<Tensor>> {
        let _unused = x.exp()?.sum_all()?;
        Ok(vec![x.mul(x)?.add_scalar(1.0)?])
    };
    let x0 = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], [3]).unwrap();
    let (out, c) = compile_first(&mut step, std::slice::from_ref(&x0), || f(&x0));
    assert_eq!(
        c.report.removed.ops, 2,
        "exp and sum are dead: {:?}",
        c.report
    );
    // mul and add_scalar are one fused kernel.
    assert_eq!(c.report.kernels, 1, "{:?}", c.report);
    assert_eq!((c.report.fusion.groups, c.report.fusion.ops_fused), (1, 2));
    assert_eq!(out[0].to_vec::<f64>().unwrap(), vec![2.0, 5.0, 10.0]);
    let x1 = Tensor::from_vec(vec![-1.0f64, 0.5, 4.0], [3]).unwrap();
    let (out, run) = step
        .run::<CompileError, _>(std::slice::from_ref(&x1), || {
            panic!("a replay does not run the step")
        })
        .unwrap();
    assert!(matches!(run, StepRun::Replayed));
    assert_eq!(out[0].to_vec::<f64>().unwrap(), vec![2.0, 1.25, 17.0]);
    assert_eq!(c.arena.first_conflict(), None);
}

/// A run of a flat buffer's elements (`Tensor::elements`) is recorded as a view at its offset:
/// it runs no kernel, shares its source's placed bytes, keeps that buffer alive while it is
/// read, and replays give eager's bits.
#[test]
fn element_views_are_recorded_at_their_offsets_and_replay_as_eager() {
    let f = |x: &Tensor| -> oxiflow_compile::Result<Vec<Tensor>> {
        // `y` is placed in the arena; the views read it past the last op that writes it.
        let y = x.mul_scalar(2.0)?.tanh()?;
        let mid = y.elements(5, 10)?.exp()?;
        let head = y.elements(0, 5)?;
        let tail = y.elements(15, 9)?.reshape([3, 3])?.sum(&[1], false)?;
        let joined = Tensor::concat(&[&head, &mid, &tail], 0)?;
        Ok(vec![joined.sum_all()?, joined])
    };
    let input = |k: f64| {
        Tensor::from_vec(
            (0..24).map(|i| 0.1 * i as f64 + k).collect::<Vec<f64>>(),
            [24],
        )
        .unwrap()
    };
    let mut step = CompiledStep::new();
    let x0 = input(0.3);
    let (first, c) = compile_first(&mut step, std::slice::from_ref(&x0), || f(&x0));
    let p = &c.program;
    let at: Vec<usize> = p
        .values
        .iter()
        .filter(|v| v.alias_of.is_some() && v.shape.ndim() == 1)
        .map(|v| v.alias_at)
        .collect();
    assert!(
        at.contains(&(5 * 8)) && at.contains(&(15 * 8)) && at.contains(&0),
        "the views' offsets in bytes: {at:?}"
    );
    let views = p.nodes.iter().filter(|n| n.name() == "elements");
    assert!(views.clone().count() == 3 && views.clone().all(|n| !n.runs_kernel()));
    assert_eq!(c.arena.first_conflict(), None);
    let bits = |ts: &[Tensor]| -> Vec<Vec<u64>> {
        ts.iter()
            .map(|t| {
                t.to_vec::<f64>()
                    .unwrap()
                    .into_iter()
                    .map(f64::to_bits)
                    .collect()
            })
            .collect()
    };
    assert_eq!(bits(&first), bits(&f(&x0).unwrap()));
    for k in [1.7, -2.2, 0.05] {
        let x = input(k);
        let (out, run) = step
            .run::<CompileError, _>(std::slice::from_ref(&x), || {
                panic!("a replay does not run the step")
            })
            .unwrap();
        assert!(matches!(run, StepRun::Replayed));
        assert_eq!(bits(&out), bits(&f(&x).unwrap()), "input offset {k}");
    }
}

/// The program knows which inputs it reads: one read only by dead code, or not at all, is
/// unread (a device graph neither binds nor keeps it); one handed out as an output is read.
#[test]
fn unread_inputs_are_known() {
    let mut step = CompiledStep::new();
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], [3]).unwrap();
    let (unused, dead, passed) = (
        x.mul_scalar(2.0).unwrap(),
        x.exp().unwrap(),
        x.neg().unwrap(),
    );
    let inputs = [x.clone(), unused.clone(), dead.clone(), passed.clone()];
    let (_, c) = compile_first::<CompileError>(&mut step, &inputs, || {
        let _gone = dead.sum_all()?;
        Ok(vec![x.add_scalar(1.0)?, passed.clone()])
    });
    assert_eq!(c.program.inputs_read(), vec![true, false, false, true]);
}

/// On two ranks a boxing whose result this step drops still runs (its all-gather needs every
/// member) while a dead local slice is removed, and the replay gives the eager result.
#[test]
fn communicating_boxing_is_kept_and_collectives_replay_in_order() {
    let results = run_ranks(2, Duration::from_secs(30), |rank| {
        let p = Placement::range(DeviceType::Cpu, 2).unwrap();
        let make = |k: f64| split_row(&p, [k + rank as f64, 2.0 * k]);
        let body = |x: &Tensor| -> oxiflow_compile::Result<Vec<Tensor>> {
            let _dropped = x.to_global(&p, Sbp::B)?;
            let y = x.mul_scalar(3.0)?.to_global(&p, Sbp::B)?;
            // B -> S(0) is a local slice: dead here, and removed.
            let _sliced = y.to_global(&p, Sbp::S(0))?;
            Ok(vec![y.sum_all()?])
        };
        let mut step = CompiledStep::new();
        let x = make(1.0);
        let (eager, c) = compile_first(&mut step, std::slice::from_ref(&x), || body(&x));
        assert_eq!(c.report.removed.boxings, 1, "{:?}", c.report);
        assert!(c.report.boxings >= 2);
        let x2 = make(5.0);
        let want = body(&x2).unwrap()[0].to_vec::<f64>().unwrap();
        let (got, _) = step
            .run::<CompileError, _>(std::slice::from_ref(&x2), || panic!("replays"))
            .unwrap();
        (
            eager[0].to_vec::<f64>().unwrap(),
            want,
            got[0].to_vec::<f64>().unwrap(),
        )
    });
    for (eager, want, got) in results {
        assert_eq!(eager, vec![3.0 * (1.0 + 2.0 + 2.0 + 2.0)]);
        assert_eq!(got, want);
    }
}

#[test]
fn host_read_inside_a_step_is_a_typed_error_on_every_rank() {
    let errs = run_ranks(2, Duration::from_secs(30), |rank| {
        let p = Placement::range(DeviceType::Cpu, 2).unwrap();
        let x = Tensor::from_vec(vec![rank as f64; 4], [2, 2])
            .unwrap()
            .to_global(&p, NdSbp::new([Sbp::S(0)]))
            .unwrap();
        let mut step = CompiledStep::new();
        let e = step
            .run::<CompileError, _>(std::slice::from_ref(&x), || {
                let s = x.sum_all()?;
                let v = s.to_vec::<f64>()?;
                Ok(vec![x.mul_scalar(v[0])?])
            })
            .unwrap_err();
        e.to_string()
    });
    for e in &errs {
        assert!(e.contains("to_ndarray") && e.contains("on the host"), "{e}");
    }
    assert_eq!(errs[0], errs[1]);
}

#[test]
fn a_step_called_with_other_shapes_compiles_again_naming_the_change() {
    let mut step = CompiledStep::new();
    let body = |x: &Tensor| -> oxiflow_compile::Result<Vec<Tensor>> { Ok(vec![x.tanh()?]) };
    let a = Tensor::from_vec(vec![0.5f32; 6], [2, 3]).unwrap();
    let b = Tensor::from_vec(vec![0.5f32; 12], [4, 3]).unwrap();
    step.run::<CompileError, _>(std::slice::from_ref(&a), || body(&a))
        .unwrap();
    let (_, run) = step
        .run::<CompileError, _>(std::slice::from_ref(&b), || body(&b))
        .unwrap();
    let StepRun::Compiled(c) = run else {
        panic!("other shapes compile again")
    };
    let why = c.report.recompiled_because.clone().unwrap();
    assert!(
        why.contains("input 0 is [4, 3] f32") && why.contains("instead of [2, 3] f32"),
        "{why}"
    );
    let d = a.to_dtype(DType::F64).unwrap();
    let (_, run) = step
        .run::<CompileError, _>(std::slice::from_ref(&d), || body(&d))
        .unwrap();
    let StepRun::Compiled(c) = run else {
        panic!("another dtype compiles again")
    };
    assert!(c.report.recompiled_because.clone().unwrap().contains("f64"));
    // The first key replays again.
    let (out, run) = step
        .run::<CompileError, _>(std::slice::from_ref(&a), || panic!("replays"))
        .unwrap();
    assert!(matches!(run, StepRun::Replayed));
    assert!((out[0].to_vec::<f32>().unwrap()[0] - 0.5f32.tanh()).abs() < 1e-7);
    let err = step.programs().len();
    assert_eq!(err, 3);
    let _ = CompileError::Inputs {
        detail: String::new(),
    };
}

#[test]
fn host_data_made_inside_a_step_is_a_typed_error() {
    let x = Tensor::from_vec(vec![1.0f64, 2.0], [2]).unwrap();
    let mut step = CompiledStep::new();
    let e = step
        .run::<CompileError, _>(std::slice::from_ref(&x), || {
            let batch = Tensor::from_vec(vec![3.0f64, 4.0], [2])?;
            Ok(vec![x.add(&batch)?])
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            CompileError::HostData {
                op: "from_array",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("step input"), "{e}");
    assert!(step.programs().is_empty(), "nothing is cached");
}
