//! Global-tensor gradients equal single-rank gradients (ranks as threads), and gradients get
//! their SBP by inference: a B weight used with S(0) data gets a P gradient.

use std::time::Duration;

use oxiflow_tensor::{DType, DeviceType, NdSbp, Placement, Sbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

fn vals(x: &Tensor) -> Vec<f64> {
    x.to_ndarray::<f64>().unwrap().into_raw_vec_and_offset().0
}

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
        let w1 = Tensor::randn_global([6, 4], 2, F, &p, Sbp::B)
            .unwrap()
            .requires_grad_(true);
        let b = Tensor::randn_global([4], 3, F, &p, Sbp::B)
            .unwrap()
            .requires_grad_(true);
        let w2 = Tensor::randn_global([4, 3], 4, F, &p, Sbp::B)
            .unwrap()
            .requires_grad_(true);
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
            let w1 = Tensor::randn_global([6, 4], 2, F, &p, nd(1, 2)).unwrap().requires_grad_(true);
            let b = Tensor::randn_global([4], 3, F, &p, nd(2, 1)).unwrap().requires_grad_(true);
            let w2 = Tensor::randn_global([4, 3], 4, F, &p, nd(3, 2)).unwrap().requires_grad_(true);
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
