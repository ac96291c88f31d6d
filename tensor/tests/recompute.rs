//! Activation recomputation: a block run under `recompute` gives the same output and the same
//! gradients (inputs and captured parameters) as the plain block, locally and on global layouts
//! (data parallel and tensor parallel, 1-d and 2-d meshes), keeps only its inputs in the graph,
//! and recomputes on every backward.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{
    assert_vals_close, nd_sbp, on_ranks, placed, randn_leaf, small_meshes, vals, weighted_sum,
    whole,
};
use oxiflow_tensor::{no_grad, recompute, DType, NdSbp, Result, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

/// A two-layer block with a residual: x + gelu(x w1) w2, normalized.
fn block(x: &Tensor, w1: &Tensor, w2: &Tensor, g: &Tensor) -> Result<Tensor> {
    let h = x.matmul(w1)?.gelu()?.matmul(w2)?;
    x.add(&h)?.rms_norm(g, 1e-5)
}

#[test]
fn local_block_equals_the_plain_block() {
    let x = Tensor::randn([3, 4], 1, F).requires_grad_(true);
    let w1 = Tensor::randn([4, 6], 2, F).requires_grad_(true);
    let w2 = Tensor::randn([6, 4], 3, F).requires_grad_(true);
    let g = Tensor::randn([4], 4, F).requires_grad_(true);
    let r = Tensor::randn([3, 4], 5, F);
    let plain = block(&x, &w1, &w2, &g).unwrap();
    weighted_sum(&plain, &r).backward().unwrap();
    let want: Vec<Vec<f64>> = [&x, &w1, &w2, &g]
        .iter()
        .map(|t| vals(&t.grad().unwrap()))
        .collect();
    for t in [&x, &w1, &w2, &g] {
        t.zero_grad();
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let (c1, c2, cg, counter) = (w1.clone(), w2.clone(), g.clone(), runs.clone());
    let y = recompute(&[&x], move |xs| {
        counter.fetch_add(1, Ordering::SeqCst);
        block(&xs[0], &c1, &c2, &cg)
    })
    .unwrap();
    assert_vals_close(&vals(&y), &vals(&plain), "y");
    assert_eq!(y.grad_fn_name().as_deref(), Some("recompute"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    weighted_sum(&y, &r).backward().unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the backward reruns the block"
    );
    for (t, w) in [&x, &w1, &w2, &g].iter().zip(&want) {
        assert_vals_close(&vals(&t.grad().unwrap()), w, "grad");
    }
}

#[test]
fn parameters_only_and_no_grad_paths() {
    // No input requires a gradient, a captured parameter does: the node is still recorded.
    let x = Tensor::randn([2, 3], 1, F);
    let w = Tensor::randn([3, 3], 2, F).requires_grad_(true);
    let cw = w.clone();
    let y = recompute(&[&x], move |xs| xs[0].matmul(&cw)?.tanh()).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    let got = vals(&w.grad().unwrap());
    w.zero_grad();
    x.matmul(&w)
        .unwrap()
        .tanh()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_vals_close(&got, &vals(&w.grad().unwrap()), "w grad");
    // Under no_grad it is a plain call with no history.
    let _ng = no_grad();
    let cw = w.clone();
    let y = recompute(&[&x], move |xs| xs[0].matmul(&cw)).unwrap();
    assert!(y.grad_fn_name().is_none());
}

#[test]
fn nested_blocks_and_two_backwards() {
    let x = Tensor::randn([2, 4], 7, F).requires_grad_(true);
    let w = Tensor::randn([4, 4], 8, F).requires_grad_(true);
    let plain = |x: &Tensor| -> Tensor {
        let a = x.matmul(&w).unwrap().tanh().unwrap();
        a.matmul(&w).unwrap().sigmoid().unwrap()
    };
    plain(&x).sum_all().unwrap().backward().unwrap();
    let (gx, gw) = (vals(&x.grad().unwrap()), vals(&w.grad().unwrap()));
    x.zero_grad();
    w.zero_grad();
    let (wa, wb) = (w.clone(), w.clone());
    let y = recompute(&[&x], move |xs| {
        let wi = wa.clone();
        let a = recompute(&[&xs[0]], move |ys| ys[0].matmul(&wi)?.tanh())?;
        a.matmul(&wa)?.sigmoid()
    })
    .unwrap();
    let _keep = wb;
    let loss = y.sum_all().unwrap();
    loss.backward_retaining().unwrap();
    assert_vals_close(&vals(&x.grad().unwrap()), &gx, "x grad");
    assert_vals_close(&vals(&w.grad().unwrap()), &gw, "w grad");
    // A second backward through the retained graph accumulates the same gradients again.
    loss.backward().unwrap();
    let twice: Vec<f64> = gw.iter().map(|v| 2.0 * v).collect();
    assert_vals_close(&vals(&w.grad().unwrap()), &twice, "w grad twice");
    // That one released the saved block inputs: a third is a typed error naming the node.
    let err = loss.backward().unwrap_err().to_string();
    assert!(
        err.contains("recompute") && err.contains("released"),
        "{err}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Global inputs and parameters in random layouts (P included): recomputed gradients equal
    /// the plain block's on one rank.
    #[test]
    fn global_layouts_equal_one_rank(
        rows in 1usize..6,
        p in placed(small_meshes()),
        x_seed: u64,
        w_seed: u64,
    ) {
        let xs = nd_sbp(p.ndim(), 2, x_seed, false);
        let ws = nd_sbp(p.ndim(), 2, w_seed, false);
        let x = Tensor::randn([rows, 4], 1, F).requires_grad_(true);
        let w1 = Tensor::randn([4, 5], 2, F).requires_grad_(true);
        let w2 = Tensor::randn([5, 4], 3, F).requires_grad_(true);
        let g = Tensor::randn([4], 4, F).requires_grad_(true);
        block(&x, &w1, &w2, &g).unwrap().sum_all().unwrap().backward().unwrap();
        let want: Vec<Vec<f64>> =
            [&x, &w1, &w2, &g].iter().map(|t| vals(&t.grad().unwrap())).collect();
        let got = on_ranks(&p, |_| {
            let b = NdSbp::broadcast(p.ndim());
            let make = |shape: Vec<usize>, seed, s: &NdSbp| {
                randn_leaf(shape, seed, &p, s.clone())
            };
            let x = make(vec![rows, 4], 1, &xs);
            let w1 = make(vec![4, 5], 2, &ws);
            let w2 = make(vec![5, 4], 3, &b);
            let g = make(vec![4], 4, &b);
            let (c1, c2, cg) = (w1.clone(), w2.clone(), g.clone());
            let y = recompute(&[&x], move |v| block(&v[0], &c1, &c2, &cg)).unwrap();
            y.sum_all().unwrap().backward().unwrap();
            [&x, &w1, &w2, &g]
                .iter()
                .map(|t| whole(&t.grad().unwrap(), &p))
                .collect::<Vec<_>>()
        });
        for rank in got {
            for (a, b) in rank.iter().zip(&want) {
                for (u, v) in a.iter().zip(b) {
                    prop_assert!((u - v).abs() <= 1e-9 * (1.0 + v.abs()), "{u} vs {v}");
                }
            }
        }
    }
}
