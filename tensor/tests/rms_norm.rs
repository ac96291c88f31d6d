//! RMS norm: the kernel against a direct f64 formula, its gradients against finite
//! differences, and global layouts (1-d and 2-d meshes, uneven splits, P inputs) against one
//! rank.

mod common;

use common::{
    assert_grad_matches_fd, nd_sbp, on_ranks, placed, small_meshes, vals, weighted_sum, whole, Tol,
};
use oxiflow_tensor::{DType, NdSbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

/// sum(rms_norm(x, w) * r): a scalar whose gradient reaches every output element.
fn loss(x: &Tensor, w: &Tensor, r: &Tensor) -> Tensor {
    weighted_sum(&x.rms_norm(w, 1e-5).unwrap(), r)
}

#[test]
fn forward_matches_the_formula() {
    let x = Tensor::randn([3, 5], 1, F);
    let w = Tensor::randn([5], 2, F);
    let y = vals(&x.rms_norm(&w, 1e-5).unwrap());
    let (xv, wv) = (vals(&x), vals(&w));
    for row in 0..3 {
        let r = &xv[row * 5..row * 5 + 5];
        let ms = r.iter().map(|v| v * v).sum::<f64>() / 5.0;
        for j in 0..5 {
            let want = r[j] / (ms + 1e-5).sqrt() * wv[j];
            assert!(
                (y[row * 5 + j] - want).abs() < 1e-12,
                "{} vs {want}",
                y[row * 5 + j]
            );
        }
    }
    let f32x = x.cast(DType::F32).unwrap();
    let f32w = w.cast(DType::F32).unwrap();
    let y32 = f32x.rms_norm(&f32w, 1e-5).unwrap().cast(F).unwrap();
    for (a, b) in vals(&y32).iter().zip(&y) {
        assert!((a - b).abs() < 1e-5 * (1.0 + b.abs()));
    }
    assert!(x.rms_norm(&Tensor::randn([4], 2, F), 1e-5).is_err());
    assert!(x.rms_norm(&w.cast(DType::F32).unwrap(), 1e-5).is_err());
}

#[test]
fn gradients_match_finite_differences() {
    let x = Tensor::randn([2, 4], 3, F).requires_grad_(true);
    let w = Tensor::randn([4], 4, F).requires_grad_(true);
    let r = Tensor::randn([2, 4], 5, F);
    loss(&x, &w, &r).backward().unwrap();
    let (xd, wd) = (x.detach(), w.detach());
    let tol = Tol::Rel(1e-6);
    assert_grad_matches_fd(&x, &x.grad().unwrap(), tol, |x| loss(x, &wd, &r), "x");
    assert_grad_matches_fd(&w, &w.grad().unwrap(), tol, |w| loss(&xd, w, &r), "weight");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn global_layouts_equal_one_rank(
        rows in 1usize..7,
        cols in 1usize..6,
        p in placed(small_meshes()),
        sbp_seed: u64,
        w_seed: u64,
    ) {
        let xs = nd_sbp(p.ndim(), 2, sbp_seed, true);
        let ws = nd_sbp(p.ndim(), 1, w_seed, true);
        let x = Tensor::randn([rows, cols], 11, F).requires_grad_(true);
        let w = Tensor::randn([cols], 12, F).requires_grad_(true);
        let r = Tensor::randn([rows, cols], 13, F);
        let y = vals(&x.rms_norm(&w, 1e-5).unwrap());
        loss(&x, &w, &r).backward().unwrap();
        let (gx, gw) = (vals(&x.grad().unwrap()), vals(&w.grad().unwrap()));
        let got = on_ranks(&p, |_| {
            let make = |shape: Vec<usize>, seed, s: &NdSbp| {
                Tensor::randn_global(shape, seed, F, &p, s.clone()).unwrap().requires_grad_(true)
            };
            let x = make(vec![rows, cols], 11, &xs);
            let w = make(vec![cols], 12, &ws);
            let r = Tensor::randn_global([rows, cols], 13, F, &p, NdSbp::broadcast(p.ndim())).unwrap();
            let y = whole(&x.rms_norm(&w, 1e-5).unwrap(), &p);
            loss(&x, &w, &r).backward().unwrap();
            (y, whole(&x.grad().unwrap(), &p), whole(&w.grad().unwrap(), &p))
        });
        for (gy, ggx, ggw) in got {
            for (a, b) in gy.iter().zip(&y).chain(ggx.iter().zip(&gx)).chain(ggw.iter().zip(&gw)) {
                prop_assert!((a - b).abs() < 1e-9 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }
}
