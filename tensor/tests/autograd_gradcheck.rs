//! Autograd against finite differences (f64): random small graphs (proptest) over the op set,
//! plus fixed checks of the loss/embedding/max/layer-norm rules, accumulation and no_grad.

mod common;

use common::{vals, weighted_sum};
use oxiflow_tensor::{no_grad, DType, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

fn t(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape.to_vec()).unwrap()
}

/// Builds h from the leaves by applying `ops` in order; returns sum(h * r).
fn program(ops: &[u8], a: &Tensor, b: &Tensor, c: &Tensor, d: &Tensor) -> Tensor {
    let r = Tensor::randn([2, 3], 99, F);
    let mut h = a.clone();
    for &op in ops {
        h = match op % 17 {
            0 => h.matmul(b).unwrap(),
            1 => h.add(c).unwrap(),
            2 => h.tanh().unwrap(),
            3 => h.sigmoid().unwrap().mul(&h).unwrap(),
            4 => h.softmax(-1).unwrap(),
            5 => h.log_softmax(-1).unwrap(),
            6 => h.layer_norm(c, d, 1e-5).unwrap(),
            7 => h.sub(&h.mean(&[-1], true).unwrap()).unwrap(),
            8 => h
                .div(&h.square().unwrap().add_scalar(1.0).unwrap())
                .unwrap(),
            9 => h.transpose(0, 1).unwrap().reshape([2, 3]).unwrap(),
            10 => {
                let l = h.narrow(1, 0, 1).unwrap().exp().unwrap();
                let rr = h.narrow(1, 1, 2).unwrap();
                Tensor::concat(&[&l, &rr], 1).unwrap()
            }
            11 => a.mul(&h.sum(&[0], false).unwrap()).unwrap(),
            12 => h
                .square()
                .unwrap()
                .add_scalar(1.0)
                .unwrap()
                .rdiv_scalar(1.0)
                .unwrap(),
            13 => h
                .reshape([1, 2, 3])
                .unwrap()
                .bmm(&b.reshape([1, 3, 3]).unwrap())
                .unwrap()
                .reshape([2, 3])
                .unwrap(),
            14 => h.gelu().unwrap().mul_scalar(1.5).unwrap().sub(c).unwrap(),
            15 => {
                // Runs of the flat elements, one of them through exp.
                let f = h.reshape([6]).unwrap();
                let (head, tail) = (f.elements(0, 1).unwrap(), f.elements(5, 1).unwrap());
                let mid = f.elements(1, 4).unwrap().exp().unwrap();
                Tensor::concat(&[&head, &mid, &tail], 0)
                    .unwrap()
                    .reshape([2, 3])
                    .unwrap()
            }
            _ => h
                .mul(&h.exp().unwrap().pow_scalar(0.5).unwrap())
                .unwrap()
                .neg()
                .unwrap(),
        };
    }
    weighted_sum(&h, &r)
}

/// Central finite differences of `f` at `x` (the leaf index `which`).
fn fd(
    leaves: &[Vec<f64>],
    shapes: &[&[usize]],
    which: usize,
    f: &dyn Fn(&[Tensor]) -> Tensor,
) -> Vec<f64> {
    let eps = 1e-6;
    let _ng = no_grad();
    (0..leaves[which].len())
        .map(|i| {
            let eval = |delta: f64| {
                let ts: Vec<Tensor> = leaves
                    .iter()
                    .zip(shapes)
                    .enumerate()
                    .map(|(j, (v, s))| {
                        let mut v = v.clone();
                        if j == which {
                            v[i] += delta;
                        }
                        t(&v, s)
                    })
                    .collect();
                vals(&f(&ts))[0]
            };
            (eval(eps) - eval(-eps)) / (2.0 * eps)
        })
        .collect()
}

fn check_grads(leaves: &[Vec<f64>], shapes: &[&[usize]], f: &dyn Fn(&[Tensor]) -> Tensor) {
    let ts: Vec<Tensor> = leaves
        .iter()
        .zip(shapes)
        .map(|(v, s)| t(v, s).requires_grad_(true))
        .collect();
    f(&ts).backward().unwrap();
    for (i, x) in ts.iter().enumerate() {
        let want = fd(leaves, shapes, i, f);
        let got = x
            .grad()
            .map(|g| vals(&g))
            .unwrap_or_else(|| vec![0.0; want.len()]);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "leaf {i}: autograd {got:?} vs finite differences {want:?}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_graphs_match_finite_differences(
        ops in proptest::collection::vec(0u8..16, 1..6),
        a in proptest::collection::vec(-1.0f64..1.0, 6),
        b in proptest::collection::vec(-1.0f64..1.0, 9),
        c in proptest::collection::vec(0.5f64..1.5, 3),
        d in proptest::collection::vec(-1.0f64..1.0, 3),
    ) {
        let shapes: [&[usize]; 4] = [&[2, 3], &[3, 3], &[3], &[3]];
        check_grads(&[a, b, c, d], &shapes, &|x| program(&ops, &x[0], &x[1], &x[2], &x[3]));
    }
}

#[test]
fn cross_entropy_and_embedding_gradients() {
    let labels = Tensor::from_vec(vec![2i64, 0, 1], [3]).unwrap();
    let ids = Tensor::from_vec(vec![1i64, 4, 1, 0], [4]).unwrap();
    let logits: Vec<f64> = (0..9).map(|i| (i as f64 * 0.37).sin()).collect();
    let w: Vec<f64> = (0..15).map(|i| (i as f64 * 0.61).cos()).collect();
    let shapes: [&[usize]; 2] = [&[3, 3], &[5, 3]];
    check_grads(&[logits, w], &shapes, &|x| {
        let ce = x[0].cross_entropy(&labels).unwrap().mean_all().unwrap();
        let e = Tensor::embedding(&ids, &x[1])
            .unwrap()
            .tanh()
            .unwrap()
            .sum_all()
            .unwrap();
        ce.add(&e).unwrap()
    });
}

#[test]
fn max_gradient_goes_to_the_maxima() {
    let x = t(&[1.0, 5.0, 3.0, 2.0, 2.0, -1.0], &[2, 3]).requires_grad_(true);
    x.max(&[1], false)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = vals(&x.grad().unwrap());
    assert_eq!(g, vec![0.0, 1.0, 0.0, 0.5, 0.5, 0.0]);
}

#[test]
fn gradients_accumulate_across_backward_calls_and_zero_grad_clears() {
    let w = t(&[1.0, 2.0, 3.0], &[3]).requires_grad_(true);
    for _ in 0..2 {
        w.square().unwrap().sum_all().unwrap().backward().unwrap();
    }
    assert_eq!(vals(&w.grad().unwrap()), vec![4.0, 8.0, 12.0]);
    w.zero_grad();
    assert!(w.grad().is_none());
    // A tensor used twice in one graph gets both contributions, each node runs once.
    let y = w.mul(&w).unwrap().add(&w).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(vals(&w.grad().unwrap()), vec![3.0, 5.0, 7.0]);
}

#[test]
fn no_grad_records_nothing_and_backward_without_history_fails() {
    let w = t(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = {
        let _g = no_grad();
        w.square().unwrap().sum_all().unwrap()
    };
    assert!(!y.requires_grad());
    assert!(y.grad_fn_name().is_none());
    let err = y.backward().unwrap_err().to_string();
    assert!(err.contains("does not require grad"), "{err}");
    let z = w.square().unwrap();
    assert_eq!(z.grad_fn_name().as_deref(), Some("square"));
    let bad_seed = Tensor::ones([3], F);
    assert!(z.backward_with(&bad_seed).is_err());
}

#[test]
fn layer_norm_parameter_gradients() {
    let x: Vec<f64> = (0..8).map(|i| (i as f64 * 1.3).sin() * 2.0).collect();
    let w: Vec<f64> = vec![1.0, 0.5, -0.3, 2.0];
    let b: Vec<f64> = vec![0.1, 0.2, 0.3, 0.4];
    let r = Tensor::randn([2, 4], 5, F);
    let shapes: [&[usize]; 3] = [&[2, 4], &[4], &[4]];
    check_grads(&[x, w, b], &shapes, &|v| {
        weighted_sum(&v[0].layer_norm(&v[1], &v[2], 1e-5).unwrap(), &r)
    });
}

#[test]
fn layer_norm_returns_its_statistics_and_dispatch_refuses_several_outputs() {
    let x = t(&[1.0, 2.0, 4.0, -1.0, 0.0, 1.0], &[2, 3]);
    let (w, b) = (Tensor::ones([3], F), Tensor::zeros([3], F));
    let (y, mean, rstd) = x.layer_norm_stats(&w, &b, 0.0).unwrap();
    assert_eq!(mean.shape().dims(), &[2, 1]);
    let m = vals(&mean);
    assert!(
        (m[0] - 7.0 / 3.0).abs() < 1e-12 && m[1].abs() < 1e-12,
        "{m:?}"
    );
    let r = vals(&rstd);
    let var0 = [1.0f64, 2.0, 4.0]
        .iter()
        .map(|v| (v - 7.0 / 3.0).powi(2))
        .sum::<f64>()
        / 3.0;
    assert!((r[0] - 1.0 / var0.sqrt()).abs() < 1e-12, "{r:?}");
    assert!((r[1] - 1.0 / (2.0f64 / 3.0).sqrt()).abs() < 1e-12, "{r:?}");
    assert_eq!(vals(&y), vals(&x.layer_norm(&w, &b, 0.0).unwrap()));
    let op = oxiflow_tensor::NormOp::LayerNorm {
        eps: oxiflow_tensor::F64Bits::new(0.0),
    };
    let err = oxiflow_tensor::dispatch(op.clone().into(), &[&x, &w, &b])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer_norm") && err.contains("dispatch_multi"),
        "{err}"
    );
    assert_eq!(
        oxiflow_tensor::dispatch_multi(op.into(), &[&x, &w, &b])
            .unwrap()
            .len(),
        3
    );
}
