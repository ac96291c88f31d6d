//! The fused MLP with its residual add (`residual_mlp`), keeping GELU's output or computing it
//! again in the backward (`residual_mlp_with(.., (true, _))`, which keeps one tensor less), against
//! the same layers unfused (`linear` with GELU, `linear`, `add`) on one rank in f64: the output and the gradients of
//! x, both weights, both biases and the residual, in f64, f32 and bf16, with rows split
//! unevenly over 1-d and 2-d meshes (empty shards included) and rows whole, 2-d and 3-d x; bad
//! shapes refused.

mod common;

use std::time::Duration;

use common::{placement, saved_count, vals};
use oxiflow_ops::linear::linear;
use oxiflow_ops::linear::Activation;
use oxiflow_ops::residual_mlp::{residual_mlp, residual_mlp_with};
use oxiflow_tensor::{run_ranks, DType, MatmulPrecision, NdSbp, Sbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;
const B: Sbp = Sbp::B;

/// How the MLP runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Unfused,
    Fused,
    /// Fused, GELU's output computed again in the backward.
    Recomputing,
}

/// (y, dx, dw_fc, db_fc, dw_proj, db_proj, dresidual) of `sum(y * r)` for the six inputs made
/// by `make` (global or local), along `path`, as whole values.
fn run(inputs: &[Tensor; 7], path: Path, whole: &dyn Fn(&Tensor) -> Vec<f64>) -> Vec<Vec<f64>> {
    let [x, w_fc, b_fc, w_proj, b_proj, res, r] = inputs;
    let y = match path {
        Path::Unfused => {
            let h = linear(x, w_fc, Some(b_fc), Activation::Gelu).unwrap();
            let m = linear(&h, w_proj, Some(b_proj), Activation::None).unwrap();
            res.add(&m).unwrap()
        }
        Path::Fused | Path::Recomputing => {
            let recompute = path == Path::Recomputing;
            let y = residual_mlp_with(
                x,
                w_fc,
                b_fc,
                w_proj,
                b_proj,
                res,
                (recompute, MatmulPrecision::F32),
            )
            .unwrap();
            // x, both weights and pre, and h unless it is computed again.
            let kept = saved_count(&y);
            assert_eq!(kept, Some(if recompute { 4 } else { 5 }), "{path:?}");
            y
        }
    };
    y.mul(r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![whole(&y)];
    for t in [x, w_fc, b_fc, w_proj, b_proj, res] {
        out.push(whole(&t.grad().expect("a gradient")));
    }
    out
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 1e-4,
        _ => 2f64.powi(-5),
    }
}

/// Checks the fused op on `mesh` with x, residual and r laid out by `x_sbp` (weights
/// broadcast) against the unfused f64 layers on one rank.
fn check(
    mesh: &[usize],
    x_sbp: NdSbp,
    lead: &[usize],
    (c, f): (usize, usize),
    dtype: DType,
    seed: u64,
) {
    let p = placement(mesh, seed);
    let what = format!("{p} x {x_sbp} lead {lead:?} C {c} F {f} in {dtype}");
    let mut xs = lead.to_vec();
    xs.push(c);
    let shapes: [Vec<usize>; 7] = [
        xs.clone(),
        vec![c, f],
        vec![f],
        vec![f, c],
        vec![c],
        xs.clone(),
        xs.clone(),
    ];
    let make = |dt: DType| -> [Tensor; 7] {
        std::array::from_fn(|i| {
            Tensor::randn(shapes[i].clone(), seed * 10 + i as u64, dtype)
                .to_dtype(dt)
                .unwrap()
                .mul_scalar(if i == 1 || i == 3 { 0.5 } else { 1.0 })
                .unwrap()
        })
    };
    let local = make(F).map(|t| t.detach().requires_grad_(true));
    let want = run(&local, Path::Unfused, &|t| vals(t));
    let b = NdSbp::broadcast(p.ndim());
    let got = run_ranks(p.num_ranks(), Duration::from_secs(60), |_| {
        let ins: [Tensor; 7] = std::array::from_fn(|i| {
            let t = make(dtype)[i].to_global(&p, b.clone()).unwrap();
            let t = match i {
                0 | 5 | 6 => t.to_global(&p, x_sbp.clone()).unwrap(),
                _ => t,
            };
            t.detach().requires_grad_(i < 6)
        });
        let all = |t: &Tensor| vals(&t.to_global(&p, b.clone()).unwrap());
        [Path::Fused, Path::Recomputing].map(|path| {
            let fresh: [Tensor; 7] = std::array::from_fn(|i| ins[i].detach().requires_grad_(i < 6));
            let outs = run(&fresh, path, &all);
            assert_eq!(
                fresh[0].grad().unwrap().nd_sbp(),
                Some(&x_sbp),
                "{what}: dx layout"
            );
            outs
        })
    });
    let tol = tolerance(dtype);
    let names = [
        "y",
        "dx",
        "dw_fc",
        "db_fc",
        "dw_proj",
        "db_proj",
        "dresidual",
    ];
    for (rank, outs) in got
        .into_iter()
        .enumerate()
        .flat_map(|(rank, paths)| paths.map(|o| (rank, o)))
    {
        for ((name, g), w) in names.iter().zip(&outs).zip(&want) {
            let scale = w.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(
                    (a - b).abs() <= tol * scale,
                    "{what} rank {rank} {name}[{i}]: {a} vs {b} (scale {scale})"
                );
            }
            assert_eq!(g.len(), w.len(), "{what} {name}");
        }
    }
}

#[test]
fn the_fused_mlp_equals_its_layers_in_every_layout() {
    let s0 = NdSbp::new([Sbp::S(0)]);
    for dtype in [F, DType::F32, DType::BF16] {
        check(&[1], NdSbp::new([B]), &[5], (4, 16), dtype, 1);
        check(&[2], s0.clone(), &[5], (4, 16), dtype, 2);
        // 2 rows over 3 ranks: an empty shard.
        check(&[3], s0.clone(), &[2], (8, 8), dtype, 3);
        check(&[2], NdSbp::new([B]), &[2, 3], (4, 8), dtype, 4);
        check(
            &[2, 2],
            NdSbp::new([Sbp::S(0), B]),
            &[3, 2],
            (4, 16),
            dtype,
            5,
        );
        check(
            &[2, 2],
            NdSbp::new([Sbp::S(1), Sbp::S(0)]),
            &[2, 3],
            (8, 8),
            dtype,
            6,
        );
    }
}

#[test]
fn bad_shapes_are_refused() {
    let t = |s: &[usize]| Tensor::randn(s.to_vec(), 1, F);
    let (x, wf, bf, wp, bp) = (t(&[3, 4]), t(&[4, 8]), t(&[8]), t(&[8, 4]), t(&[4]));
    assert!(residual_mlp(&x, &wf, &bf, &wp, &bp, &x).is_ok());
    for (wf2, bf2, wp2, bp2, r2) in [
        (t(&[5, 8]), bf.clone(), wp.clone(), bp.clone(), x.clone()),
        (wf.clone(), t(&[7]), wp.clone(), bp.clone(), x.clone()),
        (wf.clone(), bf.clone(), t(&[8, 5]), bp.clone(), x.clone()),
        (wf.clone(), bf.clone(), wp.clone(), t(&[5]), x.clone()),
        (wf.clone(), bf.clone(), wp.clone(), bp.clone(), t(&[2, 4])),
    ] {
        let e = residual_mlp(&x, &wf2, &bf2, &wp2, &bp2, &r2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("residual_mlp"), "{e}");
    }
    let e = residual_mlp(&x, &wf.to_dtype(DType::F32).unwrap(), &bf, &wp, &bp, &x)
        .unwrap_err()
        .to_string();
    assert!(e.contains("residual_mlp"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    #[test]
    fn the_fused_mlp_equals_its_layers(
        rows in 0usize..7,
        c in 1usize..6,
        f in 1usize..10,
        dtype in prop::sample::select(vec![F, DType::F32, DType::BF16]),
        mesh in prop::sample::select(vec![vec![1usize], vec![2], vec![3], vec![2, 2]]),
        codes in proptest::collection::vec(0usize..2, 2),
        seed in 0u64..500,
    ) {
        let sbp = NdSbp::new(mesh.iter().zip(&codes).map(|(_, &k)| [Sbp::S(0), B][k]));
        check(&mesh, sbp, &[rows], (c, f), dtype, seed);
    }
}
