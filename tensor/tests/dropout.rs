//! Dropout: values against the counter-based formula (`rng::uniform(seed, global index) >= p`),
//! its gradient against finite differences, typed errors for a bad `p`, and the mask identical
//! for every global layout (1-d and 2-d meshes, uneven splits on any dim, P inputs) and a local
//! run; a micro-batch's framed dropout (`dropout_in`) is its rows of the whole batch's.

mod common;

use common::{
    assert_grad_matches_fd, nd_sbp, on_ranks, one_mesh_of, placed, placement, randn_leaf, vals,
    weighted_sum, whole, Tol,
};
use oxiflow_tensor::{rng, DType, NdSbp, Tensor, TensorError};
use proptest::prelude::*;

const F: DType = DType::F64;

/// The dropout of element `i` with value `x`, as the op defines it.
fn want(x: f64, i: usize, p: f64, seed: u64) -> f64 {
    if rng::uniform(seed, i as u64) >= p {
        x * (1.0 / (1.0 - p))
    } else {
        0.0
    }
}

#[test]
fn values_follow_the_counter_based_mask() {
    let x = Tensor::randn([40, 50], 1, F);
    let xv = vals(&x);
    for (p, seed) in [(0.3, 42u64), (0.9, 7), (0.5, u64::MAX)] {
        let y = vals(&x.dropout(p, seed).unwrap());
        for (i, (&a, &b)) in y.iter().zip(&xv).enumerate() {
            assert_eq!(a, want(b, i, p, seed), "p {p} seed {seed} element {i}");
        }
        let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / y.len() as f64;
        assert!((kept - (1.0 - p)).abs() < 0.03, "p {p}: kept {kept}");
    }
    let a = vals(&x.dropout(0.5, 1).unwrap());
    let b = vals(&x.dropout(0.5, 2).unwrap());
    assert_ne!(a, b, "another seed draws another mask");
    let y32 = x.cast(DType::F32).unwrap().dropout(0.3, 42).unwrap();
    assert_eq!(y32.dtype(), DType::F32);
    for (i, (a, b)) in vals(&y32.cast(F).unwrap()).iter().zip(&xv).enumerate() {
        let w = want(*b, i, 0.3, 42);
        assert!((a - w).abs() < 1e-6 * (1.0 + w.abs()), "f32 element {i}");
    }
}

#[test]
fn zero_p_is_the_identity_and_bad_p_is_a_typed_error() {
    let x = Tensor::randn([3, 4], 1, F);
    assert!(x.dropout(0.0, 9).unwrap().same(&x));
    for p in [1.0, 1.5, -0.1, f64::NAN, f64::INFINITY] {
        match x.dropout(p, 9) {
            Err(TensorError::Shape { op, detail, .. }) => {
                assert_eq!(op, "dropout");
                assert!(detail.contains("[0, 1)"), "{detail}");
            }
            other => panic!("p {p}: expected a shape error, got {other:?}"),
        }
    }
    let xi = x.cast(DType::I64).unwrap();
    assert!(matches!(xi.dropout(0.5, 1), Err(TensorError::DType { .. })));
}

#[test]
fn a_framed_dropout_is_its_rows_of_the_frame() {
    let full = Tensor::randn([6, 4, 5], 3, F);
    let (p, seed) = (0.4, 11u64);
    let dropped = full.dropout(p, seed).unwrap();
    let frame = full.shape().clone();
    for j in 0..3 {
        let rows = full.narrow(0, 2 * j, 2).unwrap();
        let want = vals(&dropped.narrow(0, 2 * j, 2).unwrap());
        let local = rows.dropout_in(p, seed, &frame, &[2 * j, 0, 0]).unwrap();
        assert_eq!(vals(&local), want, "micro-batch {j}, local");
        // The same through a global layout split on another dim, and its gradient is the
        // framed mask (d/dx sum(dropout(x)) = keep / (1 - p)).
        let pl = placement(&[2], 0);
        let runs = on_ranks(&pl, |_| {
            let x = rows
                .to_global(&pl, NdSbp::broadcast(1))
                .unwrap()
                .to_global(&pl, NdSbp::new([oxiflow_tensor::Sbp::S(2)]))
                .unwrap()
                .requires_grad_(true);
            let y = x.dropout_in(p, seed, &frame, &[2 * j, 0, 0]).unwrap();
            y.sum_all().unwrap().backward().unwrap();
            (whole(&y, &pl), whole(&x.grad().unwrap(), &pl))
        });
        let ones = vals(
            &Tensor::ones([2, 4, 5], F)
                .dropout_in(p, seed, &frame, &[2 * j, 0, 0])
                .unwrap(),
        );
        for (y, g) in runs {
            assert_eq!(y, want, "micro-batch {j}, global");
            assert_eq!(g, ones, "micro-batch {j}, gradient");
        }
    }
    // A tensor that does not lie in the frame is refused before anything runs.
    let rows = full.narrow(0, 0, 2).unwrap();
    for (frame, at) in [
        (vec![6, 4, 5], vec![5, 0, 0]),
        (vec![6, 4], vec![0, 0]),
        (vec![6, 4, 5], vec![0, 0]),
        (vec![6, 4, 5], vec![usize::MAX, 0, 0]),
        (vec![usize::MAX, usize::MAX, 5], vec![0, 0, 0]),
    ] {
        let frame = oxiflow_tensor::Shape::new(frame);
        match rows.dropout_in(p, seed, &frame, &at) {
            Err(TensorError::Shape { op, detail, .. }) => {
                assert_eq!(op, "dropout");
                assert!(detail.contains("frame"), "{detail}");
            }
            other => panic!("frame {frame} at {at:?}: expected a shape error, got {other:?}"),
        }
    }
}

/// sum(dropout(x) * r).
fn loss(x: &Tensor, r: &Tensor) -> Tensor {
    weighted_sum(&x.dropout(0.4, 5).unwrap(), r)
}

#[test]
fn gradient_matches_finite_differences() {
    let x = Tensor::randn([3, 5], 2, F).requires_grad_(true);
    let r = Tensor::randn([3, 5], 3, F);
    loss(&x, &r).backward().unwrap();
    let grad = x.grad().unwrap();
    assert_grad_matches_fd(&x, &grad, Tol::Rel(1e-6), |x| loss(x, &r), "x");
    let g = vals(&grad);
    let zeros = g.iter().filter(|&&v| v == 0.0).count();
    assert!(zeros > 0 && zeros < g.len(), "the mask drops some, not all");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn the_mask_is_the_same_in_every_layout(
        dims in prop::collection::vec(1usize..6, 1..4),
        p in placed(one_mesh_of(&[&[2], &[3], &[4], &[2, 2], &[1, 3], &[3, 1]])),
        sbp_seed: u64,
        seed: u64,
    ) {
        let sbp = nd_sbp(p.ndim(), dims.len(), sbp_seed, true);
        let x = Tensor::randn(dims.clone(), 11, F).requires_grad_(true);
        let r = Tensor::randn(dims.clone(), 12, F);
        let want_y = vals(&x.dropout(0.35, seed).unwrap());
        weighted_sum(&x.dropout(0.35, seed).unwrap(), &r).backward().unwrap();
        let want_g = vals(&x.grad().unwrap());
        let got = on_ranks(&p, |_| {
            let bc = NdSbp::broadcast(p.ndim());
            let x = randn_leaf(dims.clone(), 11, &p, sbp.clone());
            let r = Tensor::randn_global(dims.clone(), 12, F, &p, bc.clone()).unwrap();
            let y = x.dropout(0.35, seed).unwrap();
            let out_sbp = y.nd_sbp().cloned();
            let yv = whole(&y, &p);
            weighted_sum(&y, &r).backward().unwrap();
            (yv, whole(&x.grad().unwrap(), &p), out_sbp)
        });
        for (y, g, out_sbp) in got {
            // Linear: no boxing before the kernel, the output keeps the input's nd-SBP.
            prop_assert_eq!(out_sbp.as_ref(), Some(&sbp));
            for (a, w) in y.iter().zip(&want_y).chain(g.iter().zip(&want_g)) {
                prop_assert!((a - w).abs() <= 1e-12 * (1.0 + w.abs()), "{a} vs {w}");
            }
            prop_assert_eq!((y.len(), g.len()), (want_y.len(), want_g.len()));
        }
    }
}
