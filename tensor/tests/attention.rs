//! Attention: the fused kernel and `attention_probs` against a naive f64 formula, gradients of
//! q, k and v against finite differences (causal and not), typed errors for bad shapes and
//! dtypes, and global layouts (1-d and 2-d meshes, uneven batch/head splits, any input nd-SBP
//! incl. P) against one rank.

mod common;

use std::time::Duration;

use common::{nd_sbp, placement};
use ndarray::ArrayD;
use oxiflow_tensor::{run_ranks, DType, NdSbp, Sbp, Tensor, TensorError};
use proptest::prelude::*;

const F: DType = DType::F64;

fn vals(x: &Tensor) -> Vec<f64> {
    x.to_ndarray::<f64>().unwrap().into_raw_vec_and_offset().0
}

fn arr(x: &Tensor) -> ArrayD<f64> {
    x.to_ndarray::<f64>().unwrap()
}

/// Naive attention: (probabilities [B, H, T, S], output [B, H, T, Dv]).
fn naive(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let (q, k, v) = (arr(q), arr(k), arr(v));
    let (b, h, t, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (s, dv) = (k.shape()[2], v.shape()[3]);
    let (mut probs, mut out) = (Vec::new(), Vec::new());
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..t {
                let live = if causal { i + 1 } else { s };
                let scores: Vec<f64> = (0..s)
                    .map(|j| {
                        (0..d)
                            .map(|e| q[[bi, hi, i, e]] * k[[bi, hi, j, e]])
                            .sum::<f64>()
                    })
                    .map(|x| x * scale)
                    .collect();
                let m = scores[..live].iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores[..live].iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = (0..s)
                    .map(|j| {
                        if j < live {
                            (scores[j] - m).exp() / z
                        } else {
                            0.0
                        }
                    })
                    .collect();
                for e in 0..dv {
                    out.push((0..s).map(|j| p[j] * v[[bi, hi, j, e]]).sum());
                }
                probs.extend(p);
            }
        }
    }
    (probs, out)
}

fn assert_near(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}: element {i}: {a} vs {b}"
        );
    }
}

#[test]
fn forward_matches_the_naive_formula() {
    // (B, H, T, S, D, Dv, causal)
    for (case, &(b, h, t, s, d, dv, causal)) in [
        (2, 3, 4, 4, 5, 5, true),
        (2, 3, 4, 4, 5, 3, false),
        (1, 2, 3, 6, 4, 2, false),
        (3, 1, 5, 5, 2, 4, true),
    ]
    .iter()
    .enumerate()
    {
        let seed = 10 * case as u64;
        let q = Tensor::randn([b, h, t, d], seed, F);
        let k = Tensor::randn([b, h, s, d], seed + 1, F);
        let v = Tensor::randn([b, h, s, dv], seed + 2, F);
        let scale = 1.0 / (d as f64).sqrt();
        let (want_p, want_y) = naive(&q, &k, &v, causal, scale);
        let y = q.attention(&k, &v, causal, scale).unwrap();
        assert_eq!(y.shape().dims(), [b, h, t, dv]);
        assert_near(&vals(&y), &want_y, 1e-12, "attention");
        let p = q.attention_probs(&k, causal, scale).unwrap();
        assert_eq!(p.shape().dims(), [b, h, t, s]);
        assert_near(&vals(&p), &want_p, 1e-12, "attention_probs");
        let f32s = |x: &Tensor| x.cast(DType::F32).unwrap();
        let y32 = f32s(&q)
            .attention(&f32s(&k), &f32s(&v), causal, scale)
            .unwrap();
        assert_eq!(y32.dtype(), DType::F32);
        assert_near(&vals(&y32.cast(F).unwrap()), &want_y, 1e-5, "attention f32");
    }
}

#[test]
fn no_keys_give_zeros() {
    let q = Tensor::randn([2, 3, 4, 5], 1, F);
    let k = Tensor::randn([2, 3, 0, 5], 2, F);
    let v = Tensor::randn([2, 3, 0, 3], 3, F);
    let y = q.attention(&k, &v, false, 1.0).unwrap();
    assert_eq!(y.shape().dims(), [2, 3, 4, 3]);
    assert!(vals(&y).iter().all(|&x| x == 0.0));
    let p = q.attention_probs(&k, false, 1.0).unwrap();
    assert_eq!(p.shape().dims(), [2, 3, 4, 0]);
}

#[test]
fn large_inputs_take_the_parallel_path_and_agree() {
    // 4 * 8 * 32 * 32 * 16 elements of work: above the rayon threshold.
    let q = Tensor::randn([4, 8, 32, 16], 1, F);
    let k = Tensor::randn([4, 8, 32, 16], 2, F);
    let v = Tensor::randn([4, 8, 32, 16], 3, F);
    let (_, want) = naive(&q, &k, &v, true, 0.25);
    let y = q.attention(&k, &v, true, 0.25).unwrap();
    assert_near(&vals(&y), &want, 1e-12, "attention");
}

/// sum(attention(q, k, v) * r): a scalar whose gradient reaches every output element.
fn loss(q: &Tensor, k: &Tensor, v: &Tensor, r: &Tensor, causal: bool) -> Tensor {
    q.attention(k, v, causal, 0.7)
        .unwrap()
        .mul(r)
        .unwrap()
        .sum_all()
        .unwrap()
}

/// sum(attention_probs(q, k) * r).
fn probs_loss(q: &Tensor, k: &Tensor, r: &Tensor, causal: bool) -> Tensor {
    q.attention_probs(k, causal, 0.7)
        .unwrap()
        .mul(r)
        .unwrap()
        .sum_all()
        .unwrap()
}

/// Checks `grads[i]` against central differences of `f` in input `i`.
fn check_fd(inputs: &[Tensor], grads: &[Tensor], f: &dyn Fn(&[Tensor]) -> Tensor) {
    for (which, grad) in grads.iter().enumerate() {
        let base = vals(&inputs[which]);
        let shape = inputs[which].shape().dims().to_vec();
        for (i, g) in vals(grad).iter().enumerate() {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[i] += delta;
                let mut xs: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
                xs[which] = Tensor::from_vec(v, shape.clone()).unwrap();
                vals(&f(&xs))[0]
            };
            let fd = (at(1e-6) - at(-1e-6)) / 2e-6;
            assert!(
                (g - fd).abs() < 1e-6 * (1.0 + fd.abs()),
                "input {which} element {i}: {g} vs {fd}"
            );
        }
    }
}

#[test]
fn gradients_match_finite_differences() {
    for causal in [false, true] {
        let s = if causal { 3 } else { 4 };
        let q = Tensor::randn([2, 2, 3, 2], 3, F).requires_grad_(true);
        let k = Tensor::randn([2, 2, s, 2], 4, F).requires_grad_(true);
        let v = Tensor::randn([2, 2, s, 3], 5, F).requires_grad_(true);
        let r = Tensor::randn([2, 2, 3, 3], 6, F);
        loss(&q, &k, &v, &r, causal).backward().unwrap();
        let grads = [q.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap()];
        check_fd(&[q, k, v], &grads, &|x| {
            loss(&x[0], &x[1], &x[2], &r, causal)
        });

        let q = Tensor::randn([1, 2, 3, 2], 7, F).requires_grad_(true);
        let k = Tensor::randn([1, 2, s, 2], 8, F).requires_grad_(true);
        let r = Tensor::randn([1, 2, 3, s], 9, F);
        probs_loss(&q, &k, &r, causal).backward().unwrap();
        let grads = [q.grad().unwrap(), k.grad().unwrap()];
        check_fd(&[q, k], &grads, &|x| probs_loss(&x[0], &x[1], &r, causal));
    }
}

#[test]
fn only_the_inputs_that_need_a_gradient_get_one() {
    let q = Tensor::randn([1, 2, 3, 2], 1, F);
    let k = Tensor::randn([1, 2, 3, 2], 2, F);
    let v = Tensor::randn([1, 2, 3, 2], 3, F).requires_grad_(true);
    let r = Tensor::randn([1, 2, 3, 2], 4, F);
    loss(&q, &k, &v, &r, true).backward().unwrap();
    assert!(q.grad().is_none() && k.grad().is_none());
    // dv = P^T r.
    let p = q.attention_probs(&k, true, 0.7).unwrap();
    let want = p.transpose(-2, -1).unwrap().bmm(&r).unwrap();
    assert_near(&vals(&v.grad().unwrap()), &vals(&want), 1e-12, "dv");
}

#[test]
fn bad_shapes_and_dtypes_are_typed_errors() {
    let t = |s: &[usize]| Tensor::randn(s.to_vec(), 1, F);
    let q = t(&[2, 3, 4, 5]);
    let shape_err = |r: oxiflow_tensor::Result<Tensor>, what: &str| match r {
        Err(TensorError::Shape { op, detail, .. }) => {
            assert!(op.starts_with("attention"), "{what}: op {op}");
            assert!(!detail.is_empty());
        }
        other => panic!("{what}: expected a shape error, got {other:?}"),
    };
    shape_err(t(&[3, 4, 5]).attention(&q, &q, false, 1.0), "3-d q");
    shape_err(
        q.attention(&t(&[2, 3, 4, 6]), &q, false, 1.0),
        "k with another D",
    );
    shape_err(
        q.attention(&t(&[2, 2, 4, 5]), &q, false, 1.0),
        "k with another H",
    );
    shape_err(
        q.attention(&t(&[1, 3, 4, 5]), &q, false, 1.0),
        "k with another B",
    );
    shape_err(
        q.attention(&q, &t(&[2, 3, 5, 5]), false, 1.0),
        "v with another S",
    );
    shape_err(q.attention(&q, &t(&[2, 3, 4]), false, 1.0), "3-d v");
    let k6 = t(&[2, 3, 6, 5]);
    shape_err(q.attention(&k6, &k6, true, 1.0), "causal with S != T");
    shape_err(
        q.attention_probs(&k6, true, 1.0),
        "causal probs with S != T",
    );
    shape_err(q.attention(&q, &q, false, f64::NAN), "NaN scale");
    assert!(q.attention(&k6, &k6, false, 1.0).is_ok());
    let dtype_err = |r: oxiflow_tensor::Result<Tensor>, what: &str| {
        assert!(matches!(r, Err(TensorError::DType { .. })), "{what}: {r:?}");
    };
    let q32 = q.cast(DType::F32).unwrap();
    dtype_err(q.attention(&q32, &q, false, 1.0), "mixed dtypes");
    let qi = q.cast(DType::I64).unwrap();
    dtype_err(qi.attention(&qi, &qi, false, 1.0), "i64");
    dtype_err(qi.attention_probs(&qi, false, 1.0), "i64 probs");
}

#[test]
fn batch_and_head_splits_stay_split() {
    // H = 3 and B = 3 over 2 ranks: uneven splits, no boxing of the inputs or the output.
    let got = run_ranks(2, Duration::from_secs(30), |_| {
        let p = placement(&[2], 0);
        let mut sbps = Vec::new();
        for sbp in [Sbp::S(0), Sbp::S(1), Sbp::B] {
            let x =
                |seed| Tensor::randn_global([3, 3, 4, 2], seed, F, &p, NdSbp::new([sbp])).unwrap();
            let y = x(1).attention(&x(2), &x(3), true, 0.5).unwrap();
            sbps.push(y.nd_sbp().cloned());
        }
        sbps
    });
    for sbps in got {
        let want: Vec<Option<NdSbp>> = [Sbp::S(0), Sbp::S(1), Sbp::B]
            .into_iter()
            .map(|s| Some(NdSbp::new([s])))
            .collect();
        assert_eq!(sbps, want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn global_layouts_equal_one_rank(
        b in 1usize..4,
        h in 1usize..4,
        t in 1usize..5,
        s in 1usize..5,
        d in 1usize..4,
        causal: bool,
        mesh in prop::sample::select(vec![
            vec![2usize], vec![4], vec![2, 2], vec![1, 3], vec![3, 1],
        ]),
        sbp_seeds: [u64; 3],
        perm_seed: u64,
    ) {
        let s = if causal { t } else { s };
        let n: usize = mesh.iter().product();
        let p = placement(&mesh, perm_seed);
        let sbps: Vec<NdSbp> = sbp_seeds.iter().map(|&z| nd_sbp(mesh.len(), 4, z, true)).collect();
        let shapes = [vec![b, h, t, d], vec![b, h, s, d], vec![b, h, s, d + 1]];
        let r_shape = vec![b, h, t, d + 1];
        let local: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, sh)| Tensor::randn(sh.clone(), 20 + i as u64, F).requires_grad_(true))
            .collect();
        let r = Tensor::randn(r_shape.clone(), 30, F);
        let want_y = vals(&local[0].attention(&local[1], &local[2], causal, 0.6).unwrap());
        loss_at(&local, &r, causal).backward().unwrap();
        let want_g: Vec<Vec<f64>> = local.iter().map(|x| vals(&x.grad().unwrap())).collect();
        let got = run_ranks(n, Duration::from_secs(30), |_| {
            let bc = NdSbp::broadcast(p.ndim());
            let xs: Vec<Tensor> = shapes
                .iter()
                .zip(&sbps)
                .enumerate()
                .map(|(i, (sh, sbp))| {
                    Tensor::randn_global(sh.clone(), 20 + i as u64, F, &p, sbp.clone())
                        .unwrap()
                        .requires_grad_(true)
                })
                .collect();
            let r = Tensor::randn_global(r_shape.clone(), 30, F, &p, bc.clone()).unwrap();
            let all = |x: Tensor| vals(&x.to_global(&p, bc.clone()).unwrap());
            let y = all(xs[0].attention(&xs[1], &xs[2], causal, 0.6).unwrap());
            loss_at(&xs, &r, causal).backward().unwrap();
            let g: Vec<Vec<f64>> = xs.iter().map(|x| all(x.grad().unwrap())).collect();
            (y, g)
        });
        for (y, g) in got {
            for (a, w) in y.iter().zip(&want_y) {
                prop_assert!((a - w).abs() < 1e-10 * (1.0 + w.abs()), "y: {a} vs {w}");
            }
            for (gi, wi) in g.iter().zip(&want_g) {
                prop_assert_eq!(gi.len(), wi.len());
                for (a, w) in gi.iter().zip(wi) {
                    prop_assert!((a - w).abs() < 1e-10 * (1.0 + w.abs()), "grad: {a} vs {w}");
                }
            }
        }
    }
}

fn loss_at(x: &[Tensor], r: &Tensor, causal: bool) -> Tensor {
    x[0].attention(&x[1], &x[2], causal, 0.6)
        .unwrap()
        .mul(r)
        .unwrap()
        .sum_all()
        .unwrap()
}
