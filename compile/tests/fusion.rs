//! Element-wise fusion on the CPU: a two-layer MLP whose activations are written from primitive
//! ops (GELU as its tanh formula, x * sigmoid(x), a bias row, residual adds, scalings), trained
//! one step (forward, backward, SGD update), compiles to fewer kernels than ops and its replays
//! equal eager bit for bit in f64, f32 and bf16; a forward chain fuses whole into one kernel
//! that replays with eager's bits; a member's value read outside its group after the root is
//! written by the group too, one read before the root or through a view keeps its producer
//! unfused; no group spans a collective but groups read through relabelling boxings; repeated
//! blocks share one generated kernel.

mod common;

use common::{bits, compile_first, split_row};
use oxiflow_compile::{CompileError, CompiledStep, StepRun};
use oxiflow_dtype::DType;
use oxiflow_tensor::Tensor;

type R<T> = oxiflow_compile::Result<T>;

/// GELU, tanh approximation, from primitive ops (9 element-wise ops).
fn gelu_formula(h: &Tensor) -> R<Tensor> {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let cube = h.mul(h)?.mul(h)?;
    let inner = cube.mul_scalar(0.044715)?.add(h)?.mul_scalar(c)?;
    Ok(inner.tanh()?.add_scalar(1.0)?.mul(h)?.mul_scalar(0.5)?)
}

/// One block: `x + 0.5 * silu(gelu(x w1 + b1)) w2 + b2`.
fn block(x: &Tensor, p: &[Tensor]) -> R<Tensor> {
    let h = x.matmul(&p[0])?.add(&p[1])?;
    let g = gelu_formula(&h)?;
    let s = g.mul(&g.sigmoid()?)?;
    Ok(s.matmul(&p[2])?.add(&p[3])?.mul_scalar(0.5)?.add(x)?)
}

/// The MLP's parameters (w1 [D, H], b1 [H], w2 [H, D], b2 [D]) of `dtype` from `seed`.
fn params(dtype: DType, seed: u64) -> Vec<Tensor> {
    let (d, h) = (8, 16);
    let shapes: [&[usize]; 4] = [&[d, h], &[h], &[h, d], &[d]];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            Tensor::randn(s.to_vec(), seed * 10 + i as u64, DType::F64)
                .mul_scalar(0.3)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .requires_grad_(true)
        })
        .collect()
}

/// One SGD step of the MLP: the loss and the updated parameters.
fn train_step(x: &Tensor, p: &[Tensor]) -> R<Vec<Tensor>> {
    let y = block(&block(x, p)?, p)?;
    let loss = y.square()?.sum_all()?;
    loss.backward()?;
    let mut out = vec![loss.detach()];
    for t in p {
        let g = t.grad().ok_or_else(|| CompileError::Inputs {
            detail: "a parameter got no gradient".into(),
        })?;
        out.push(t.detach().sub(&g.mul_scalar(0.01)?)?);
    }
    Ok(out)
}

fn check_training(dtype: DType) {
    let mut compiled = CompiledStep::new();
    let x0 = Tensor::randn([4, 8], 1, DType::F64)
        .to_dtype(dtype)
        .unwrap();
    let p0 = params(dtype, 1);
    let inputs = |x: &Tensor, p: &[Tensor]| {
        let mut v = vec![x.clone()];
        v.extend(p.iter().cloned());
        v
    };
    let (_, c) = compile_first(&mut compiled, &inputs(&x0, &p0), || train_step(&x0, &p0));
    let r = &c.report;
    eprintln!(
        "{dtype}: {} ops -> {} kernels; {} element-wise ops fused into {} kernels",
        r.ops, r.kernels, r.fusion.ops_fused, r.fusion.groups
    );
    assert!(r.fusion.groups >= 4, "{dtype}: {:?}", r.fusion);
    assert!(
        r.kernels + r.fusion.ops_fused - r.fusion.groups == r.ops - r.removed.ops - views(&c),
        "{dtype}: every fused op is one fewer kernel: {r:?}"
    );
    assert!(
        r.kernels < r.ops,
        "{dtype}: {} kernels for {} ops",
        r.kernels,
        r.ops
    );
    assert_eq!(c.arena.first_conflict(), None);
    for s in 2..5u64 {
        let x = Tensor::randn([4, 8], s, DType::F64)
            .to_dtype(dtype)
            .unwrap();
        let p = params(dtype, s);
        let eager: Vec<Vec<u64>> = train_step(&x, &p).unwrap().iter().map(bits).collect();
        let p = params(dtype, s);
        let (got, run) = compiled
            .run::<CompileError, _>(&inputs(&x, &p), || panic!("a replay does not run the step"))
            .unwrap();
        assert!(matches!(run, StepRun::Replayed));
        let got: Vec<Vec<u64>> = got.iter().map(bits).collect();
        assert_eq!(
            got, eager,
            "{dtype} step {s}: the replay's bits are eager's"
        );
    }
}

/// Op nodes of the program that run no kernel (views, and ops outside the placement).
fn views(c: &oxiflow_compile::Compiled) -> usize {
    c.program.op_count() - c.program.kernel_count()
}

#[test]
fn mlp_training_step_fuses_and_equals_eager_f64() {
    check_training(DType::F64);
}

#[test]
fn mlp_training_step_fuses_and_equals_eager_f32() {
    check_training(DType::F32);
}

#[test]
fn mlp_training_step_fuses_and_equals_eager_bf16() {
    check_training(DType::BF16);
}

/// Forward only, no gradient: bias row, GELU formula, x * sigmoid(x), scaling and a residual
/// in bf16 read through f32 casts are one kernel after the matmul.
#[test]
fn forward_chain_fuses_into_one_kernel_with_eager_bits() {
    let f = |x: &Tensor, w: &Tensor, b: &Tensor| -> R<Vec<Tensor>> {
        let h = x.matmul(w)?.add(b)?.to_dtype(DType::F32)?;
        let g = gelu_formula(&h)?;
        let s = g.mul(&g.sigmoid()?)?.mul_scalar(0.5)?;
        Ok(vec![s.to_dtype(DType::BF16)?.add(x)?])
    };
    let make = |seed: u64| {
        (
            Tensor::randn([6, 5], seed, DType::BF16),
            Tensor::randn([5, 5], seed + 1, DType::BF16),
            Tensor::randn([5], seed + 2, DType::BF16),
        )
    };
    let mut compiled = CompiledStep::new();
    let (x, w, b) = make(1);
    let inputs = [x.clone(), w.clone(), b.clone()];
    let (_, c) = compile_first(&mut compiled, &inputs, || f(&x, &w, &b));
    let r = &c.report;
    // matmul, then add, cast, 9 GELU ops, sigmoid, mul, mul_scalar, cast, add: 16 -> 1.
    assert_eq!((r.ops, r.kernels), (17, 2), "{r:?}");
    assert_eq!((r.fusion.groups, r.fusion.ops_fused), (1, 16));
    assert_eq!(r.fusion.kernels.len(), 1);
    let text = oxiflow_compile::explain(&c);
    assert!(text.contains("16 element-wise ops -> 1 kernels"), "{text}");
    for seed in [5, 9] {
        let (x, w, b) = make(seed);
        let eager = bits(&f(&x, &w, &b).unwrap()[0]);
        let (got, _) = compiled
            .run::<CompileError, _>(&[x, w, b], || panic!("replays"))
            .unwrap();
        assert_eq!(bits(&got[0]), eager);
    }
}

/// A member's value read outside its group is written by the group besides the root's when
/// every outside read comes after the root (a step output, a later reduction); read before the
/// root, or through a view, its producer stays a kernel of its own. Replays equal eager.
#[test]
fn values_read_outside_escape_only_after_the_root() {
    type Step = fn(&Tensor) -> R<Vec<Tensor>>;
    let returned: Step = |x| {
        let y = x.exp()?;
        Ok(vec![y.clone(), y.add_scalar(1.0)?])
    };
    let read_after: Step = |x| {
        let y = x.exp()?;
        let z = y.add_scalar(1.0)?;
        Ok(vec![z, y.sum_all()?])
    };
    let read_before: Step = |x| {
        let y = x.exp()?;
        let s = y.sum_all()?;
        Ok(vec![y.add_scalar(1.0)?, s])
    };
    let viewed: Step = |x| {
        let y = x.exp()?;
        let v = y.reshape([12])?;
        Ok(vec![v.sum_all()?, y.add_scalar(1.0)?])
    };
    let x = Tensor::randn([3, 4], 3, DType::F64);
    for (f, groups, escapes) in [
        (returned, 1, 1),
        (read_after, 1, 1),
        (read_before, 0, 0),
        (viewed, 0, 0),
    ] {
        let mut compiled = CompiledStep::new();
        let inputs = [x.clone()];
        let (eager, c) = compile_first(&mut compiled, &inputs, || f(&x));
        let fusion = &c.report.fusion;
        assert_eq!(
            (fusion.groups, fusion.escapes),
            (groups, escapes),
            "{:?}",
            c.report
        );
        assert_eq!(c.arena.first_conflict(), None);
        let (got, _) = compiled
            .run::<CompileError, _>(&inputs, || panic!("replays"))
            .unwrap();
        let want: Vec<Vec<u64>> = eager.iter().map(bits).collect();
        assert_eq!(got.iter().map(bits).collect::<Vec<_>>(), want);
    }
}

/// Blocks of one shape give one program: one generated kernel for all their groups.
#[test]
fn repeated_blocks_share_one_kernel() {
    let f = |x: &Tensor| -> R<Vec<Tensor>> {
        let mut h = x.clone();
        for _ in 0..4 {
            h = gelu_formula(&h)?.matmul(x)?;
        }
        Ok(vec![h])
    };
    let x = Tensor::randn([4, 4], 2, DType::F32);
    let mut compiled = CompiledStep::new();
    let inputs = [x.clone()];
    let (eager, c) = compile_first(&mut compiled, &inputs, || f(&x));
    let fusion = &c.report.fusion;
    assert_eq!(fusion.groups, 4, "{fusion:?}");
    assert_eq!(fusion.kernels.len(), 1, "{fusion:?}");
    assert_eq!(fusion.kernels[0].groups, 4);
    let (got, _) = compiled
        .run::<CompileError, _>(&inputs, || panic!("replays"))
        .unwrap();
    assert_eq!(bits(&got[0]), bits(&eager[0]));
}

/// On two ranks, an all-gather captured between two element-wise ops keeps them apart (no group
/// spans a communicating node); with the all-gather before both, they fuse. Replays equal eager.
#[test]
fn no_group_spans_a_collective() {
    use oxiflow_placement::{DeviceType, Placement};
    use oxiflow_sbp::Sbp;
    use std::time::Duration;
    let results = oxiflow_tensor::run_ranks(2, Duration::from_secs(60), |rank| {
        let p = Placement::range(DeviceType::Cpu, 2).unwrap();
        let make = |k: f64| split_row(&p, [k + rank as f64, 0.5 * k]);
        let (x, w) = (make(1.0), make(2.0));
        let mut groups = Vec::new();
        for between in [true, false] {
            let f = |x: &Tensor, w: &Tensor| -> R<Vec<Tensor>> {
                let (y, g) = if between {
                    let y = x.exp()?;
                    (y, w.to_global(&p, Sbp::B)?)
                } else {
                    let g = w.to_global(&p, Sbp::B)?;
                    (x.exp()?, g)
                };
                Ok(vec![y.mul_scalar(2.0)?, g])
            };
            let mut compiled = CompiledStep::new();
            let inputs = [x.clone(), w.clone()];
            let (eager, c) = compile_first(&mut compiled, &inputs, || f(&x, &w));
            groups.push(c.report.fusion.groups);
            let (got, _) = compiled
                .run::<CompileError, _>(&inputs, || panic!("replays"))
                .unwrap();
            for (a, b) in got.iter().zip(&eager) {
                assert_eq!(bits(a), bits(b));
            }
        }
        groups
    });
    for r in results {
        assert_eq!(
            r,
            vec![0, 1],
            "apart across the all-gather, fused without it"
        );
    }
}

/// On one rank, S(0) -> B relabels the piece as it is (no communication): a group reads through
/// it, the relabel goes with the group, and the replay equals eager.
#[test]
fn groups_read_through_relabelling_boxings() {
    use oxiflow_placement::{DeviceType, Placement};
    use oxiflow_sbp::Sbp;
    use std::time::Duration;
    let results = oxiflow_tensor::run_ranks(1, Duration::from_secs(60), |_| {
        let p = Placement::range(DeviceType::Cpu, 1).unwrap();
        let x = Tensor::randn([3, 4], 9, DType::F64)
            .to_global(&p, Sbp::S(0))
            .unwrap();
        let f = |x: &Tensor| -> R<Vec<Tensor>> {
            let y = x.exp()?.to_global(&p, Sbp::B)?;
            Ok(vec![y.mul_scalar(2.0)?.add_scalar(1.0)?])
        };
        let mut compiled = CompiledStep::new();
        let inputs = [x.clone()];
        let (eager, c) = compile_first(&mut compiled, &inputs, || f(&x));
        let fusion = c.report.fusion.clone();
        let (got, _) = compiled
            .run::<CompileError, _>(&inputs, || panic!("replays"))
            .unwrap();
        assert_eq!(bits(&got[0]), bits(&eager[0]));
        (
            fusion.groups,
            fusion.ops_fused,
            fusion.relabels,
            c.report.kernels,
            c.report.boxings,
        )
    });
    for r in results {
        assert_eq!(
            r,
            (1, 3, 1, 1, 0),
            "(groups, ops, relabels, kernels, boxings)"
        );
    }
}
