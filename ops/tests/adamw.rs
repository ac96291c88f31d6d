//! The fused AdamW passes against the AdamW formulas (f64), on local tensors and on global
//! layouts (every operand split alike or whole), and its typed errors.

mod common;

use std::time::Duration;

use common::{nd_sbp, placement, vals};
use oxiflow_ops::adamw::{adam_moment, adam_update};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

/// One AdamW step's (m, v, p) from the three fused passes.
fn step(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor) -> [Tensor; 3] {
    let (b1, b2, lr, wd, eps, t) = (0.9, 0.999, 1e-2, 0.1, 1e-8, 3);
    let m2 = adam_moment(m, g, b1, 1.0 - b1, false).unwrap();
    let v2 = adam_moment(v, g, b2, 1.0 - b2, true).unwrap();
    let bc1 = 1.0 - f64::powi(b1, t);
    let bc2 = 1.0 - f64::powi(b2, t);
    let p2 = adam_update(p, &m2, &v2, [1.0 - lr * wd, lr / bc1, 1.0 / bc2, eps]).unwrap();
    [m2, v2, p2]
}

#[test]
fn three_passes_equal_the_adamw_formulas() {
    let shape = [5, 3];
    let p = Tensor::randn(shape, 1, F);
    let g = Tensor::randn(shape, 2, F);
    let m = Tensor::randn(shape, 3, F);
    let v = Tensor::randn(shape, 4, F).abs().unwrap();
    let [m2, v2, p2] = step(&p, &g, &m, &v);
    let (b1, b2, lr, wd, eps) = (0.9f64, 0.999f64, 1e-2, 0.1, 1e-8);
    let (bc1, bc2) = (1.0 - b1.powi(3), 1.0 - b2.powi(3));
    let (pv, gv, mv, vv) = (vals(&p), vals(&g), vals(&m), vals(&v));
    for i in 0..pv.len() {
        let mi = b1 * mv[i] + (1.0 - b1) * gv[i];
        let vi = b2 * vv[i] + (1.0 - b2) * gv[i] * gv[i];
        let pi = pv[i] * (1.0 - lr * wd) - lr * (mi / bc1) / ((vi / bc2).sqrt() + eps);
        for (got, want) in [(vals(&m2)[i], mi), (vals(&v2)[i], vi), (vals(&p2)[i], pi)] {
            assert!(
                (got - want).abs() <= 1e-12 * (1.0 + want.abs()),
                "{got} vs {want}"
            );
        }
    }
    assert_eq!(m2.grad_fn_name(), None, "an update records no history");
}

#[test]
fn bad_operands_are_typed_errors() {
    let a = Tensor::randn([2, 3], 1, F);
    let err = adam_moment(&a, &Tensor::randn([3, 2], 2, F), 0.9, 0.1, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("adam_moment1") && err.contains("one shape"),
        "{err}"
    );
    let ints = Tensor::zeros([2, 3], DType::I64);
    let err = adam_update(&ints, &ints, &ints, [1.0, 1.0, 1.0, 1.0])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("adam_update") && err.contains("float"),
        "{err}"
    );
    let f32s = Tensor::randn([2, 3], 3, DType::F32);
    let err = adam_moment(&a, &f32s, 0.9, 0.1, true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("adam_moment2") && err.contains("dtype"),
        "{err}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Operands in random layouts (P included, boxed to a common split first): the global step
    /// equals the local one.
    #[test]
    fn global_layouts_equal_one_rank(
        rows in 1usize..7,
        mesh in prop::sample::select(vec![vec![2usize], vec![3], vec![2, 2], vec![1, 3]]),
        seeds in proptest::collection::vec(any::<u64>(), 5),
    ) {
        let shape = [rows, 4];
        let local = |s: u64| Tensor::randn(shape, s, F);
        let want: Vec<Vec<f64>> = step(&local(1), &local(2), &local(3), &local(4).abs().unwrap())
            .iter()
            .map(vals)
            .collect();
        let p = placement(&mesh, seeds[0]);
        let n: usize = mesh.iter().product();
        let got = run_ranks(n, Duration::from_secs(30), |_| {
            let make = |s: u64, k: usize| {
                let nd = nd_sbp(p.ndim(), 2, seeds[k], true);
                Tensor::randn_global(shape, s, F, &p, nd).unwrap()
            };
            let v = make(4, 4).abs().unwrap();
            step(&make(1, 1), &make(2, 2), &make(3, 3), &v)
                .iter()
                .map(|t| vals(&t.to_global(&p, NdSbp::broadcast(p.ndim())).unwrap()))
                .collect::<Vec<_>>()
        });
        for rank in got {
            for (g, w) in rank.iter().zip(&want) {
                for (a, b) in g.iter().zip(w) {
                    prop_assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
                }
            }
        }
    }
}
