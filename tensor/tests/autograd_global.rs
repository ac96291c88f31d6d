//! Global-tensor gradients equal single-rank gradients (ranks as threads), and gradients get
//! their SBP by inference: a B weight used with S(0) data gets a P gradient. Layer norm (a
//! three-output op whose backward reads its saved mean and rstd) on random layouts, P included.

mod common;

use std::time::Duration;

use common::{nd_sbp, placement, randn_leaf, ranks_match, saved_count, small_meshes, vals};
use oxiflow_tensor::{DType, DeviceType, NdSbp, Placement, Sbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-9 * (1.0 + y.abs()))
}

/// The graph: loss = mean(cross_entropy(tanh(x w1 + b) boxed to `mid`, w2)) + sum(x w1)/10.
fn graph(
    x: &Tensor,
    w1: &Tensor,
    b: &Tensor,
    w2: &Tensor,
    labels: &Tensor,
    mid: Option<(&Placement, NdSbp)>,
) -> Tensor {
    let h = x.matmul(w1).unwrap().add(b).unwrap().tanh().unwrap();
    let h = match mid {
        Some((p, s)) => h.to_global(p, s).unwrap(),
        None => h,
    };
    let logits = h.matmul(w2).unwrap();
    let ce = logits.cross_entropy(labels).unwrap().mean_all().unwrap();
    ce.add(
        &x.matmul(w1)
            .unwrap()
            .sum_all()
            .unwrap()
            .mul_scalar(0.1)
            .unwrap(),
    )
    .unwrap()
}

fn labels_local() -> Tensor {
    Tensor::from_vec((0..8).map(|i| (i * 5 % 3) as i64).collect::<Vec<_>>(), [8]).unwrap()
}

/// Local reference gradients of (w1, b, w2).
fn reference() -> Vec<Vec<f64>> {
    let x = Tensor::randn([8, 6], 1, F);
    let w1 = Tensor::randn([6, 4], 2, F).requires_grad_(true);
    let b = Tensor::randn([4], 3, F).requires_grad_(true);
    let w2 = Tensor::randn([4, 3], 4, F).requires_grad_(true);
    graph(&x, &w1, &b, &w2, &labels_local(), None)
        .backward()
        .unwrap();
    [&w1, &b, &w2]
        .iter()
        .map(|t| vals(&t.grad().unwrap()))
        .collect()
}

fn sbp_options(shape_dims: usize) -> Vec<Sbp> {
    let mut v = vec![Sbp::B];
    for d in 0..shape_dims {
        v.push(Sbp::S(d));
    }
    v
}

#[test]
fn data_parallel_weight_gradient_is_partial_and_correct() {
    let want = reference();
    let got = oxiflow_tensor::run_ranks(4, Duration::from_secs(30), |_| {
        let p = Placement::new_1d(DeviceType::Cpu, [0, 1, 2, 3]).unwrap();
        let x = Tensor::randn_global([8, 6], 1, F, &p, Sbp::S(0)).unwrap();
        let w1 = randn_leaf([6, 4], 2, &p, Sbp::B);
        let b = randn_leaf([4], 3, &p, Sbp::B);
        let w2 = randn_leaf([4, 3], 4, &p, Sbp::B);
        let labels = labels_local()
            .to_global(&p, Sbp::B)
            .unwrap()
            .to_global(&p, Sbp::S(0))
            .unwrap();
        graph(&x, &w1, &b, &w2, &labels, None).backward().unwrap();
        let g = w1.grad().unwrap();
        assert_eq!(
            g.nd_sbp().unwrap(),
            &NdSbp::new([Sbp::P]),
            "B weight x S(0) data -> P gradient"
        );
        [&w1, &b, &w2]
            .iter()
            .map(|t| vals(&t.grad().unwrap()))
            .collect::<Vec<_>>()
    });
    for r in got {
        for (g, w) in r.iter().zip(&want) {
            assert!(close(g, w), "{g:?} vs {w:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    #[test]
    fn global_gradients_equal_single_rank(
        two_d in any::<bool>(),
        picks in proptest::collection::vec(0usize..3, 10),
    ) {
        let want = reference();
        let got = oxiflow_tensor::run_ranks(4, Duration::from_secs(30), |_| {
            let p = if two_d {
                Placement::new(DeviceType::Cpu, vec![2, 2], vec![0, 1, 2, 3]).unwrap()
            } else {
                Placement::new_1d(DeviceType::Cpu, [0, 1, 2, 3]).unwrap()
            };
            let axes = p.ndim();
            let nd = |k: usize, ndim: usize| -> NdSbp {
                let opts = sbp_options(ndim);
                NdSbp::new((0..axes).map(|a| opts[picks[(k * 2 + a) % picks.len()] % opts.len()]))
            };
            let x = Tensor::randn_global([8, 6], 1, F, &p, nd(0, 2)).unwrap();
            let w1 = randn_leaf([6, 4], 2, &p, nd(1, 2));
            let b = randn_leaf([4], 3, &p, nd(2, 1));
            let w2 = randn_leaf([4, 3], 4, &p, nd(3, 2));
            let labels = labels_local().to_global(&p, NdSbp::broadcast(axes)).unwrap();
            let mid = nd(4, 2);
            graph(&x, &w1, &b, &w2, &labels, Some((&p, mid))).backward().unwrap();
            [&w1, &b, &w2].iter().map(|t| vals(&t.grad().unwrap())).collect::<Vec<_>>()
        });
        for r in got {
            for (g, w) in r.iter().zip(&want) {
                prop_assert!(close(g, w), "{:?} vs {:?}", g, w);
            }
        }
    }
}

/// sum(layer_norm(x, w, b) * r) over x `[rows, 3, 5]`, with the gradients of x, w and b.
fn layer_norm_loss(x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor) -> Tensor {
    x.layer_norm(w, b, 1e-5)
        .unwrap()
        .mul(r)
        .unwrap()
        .sum_all()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// x, w, b and the upstream r in random layouts (S on any dim, B, P): the gradients equal
    /// one rank's, and the statistics the backward reads are the forward's.
    #[test]
    fn layer_norm_gradients_on_global_layouts_equal_single_rank(
        rows in 1usize..5,
        mesh in small_meshes(),
        seeds in proptest::collection::vec(any::<u64>(), 5),
    ) {
        let shape = [rows, 3, 5];
        let x = Tensor::randn(shape, 1, F).requires_grad_(true);
        let w = Tensor::randn([5], 2, F).requires_grad_(true);
        let b = Tensor::randn([5], 3, F).requires_grad_(true);
        let r = Tensor::randn(shape, 4, F);
        layer_norm_loss(&x, &w, &b, &r).backward().unwrap();
        let want: Vec<Vec<f64>> = [&x, &w, &b].iter().map(|t| vals(&t.grad().unwrap())).collect();
        let p = placement(&mesh, seeds[0]);
        let n: usize = mesh.iter().product();
        let got = oxiflow_tensor::run_ranks(n, Duration::from_secs(30), |_| {
            let all_b = NdSbp::broadcast(p.ndim());
            let make = |s: &[usize], seed: u64, k: usize| {
                let nd = nd_sbp(p.ndim(), s.len(), seeds[k], true);
                Tensor::randn_global(s.to_vec(), seed, F, &p, nd).unwrap()
            };
            let x = make(&shape, 1, 1).requires_grad_(true);
            let w = make(&[5], 2, 2).requires_grad_(true);
            let b = make(&[5], 3, 3).requires_grad_(true);
            let r = make(&shape, 4, 4);
            // The saved statistics are the forward's and carry no gradient.
            let (y, mean, rstd) = x.layer_norm_stats(&w, &b, 1e-5).unwrap();
            assert!(y.requires_grad() && !mean.requires_grad() && !rstd.requires_grad());
            assert_eq!(mean.shape().dims(), &[rows, 3, 1]);
            assert_eq!(saved_count(&y), Some(4), "x, w, mean, rstd");
            layer_norm_loss(&x, &w, &b, &r).backward().unwrap();
            [&x, &w, &b]
                .iter()
                .map(|t| vals(&t.grad().unwrap().to_global(&p, all_b.clone()).unwrap()))
                .collect::<Vec<_>>()
        });
        let res = ranks_match(&got, &want);
        prop_assert!(res.is_ok(), "{res:?}");
    }
}
