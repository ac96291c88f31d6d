//! Attention. `flash_attention` (the fused op on `[B, T, H, D]`): the CPU kernel's o, lse, dq,
//! dk, dv against a naive f64 formula on never-zero data (several query and key blocks, causal
//! and not, S != T, Dv != D, the parallel path), the op against the composed reference
//! (`attention_probs` + `bmm` on permuted heads, f64) in value and gradient on global layouts
//! (1-d and 2-d meshes, batch and head splits, uneven and empty shards, broadcast, P inputs;
//! grouped-query heads against key/value heads repeated to the query heads),
//! 16-bit operands through f32, edge shapes and typed errors. `attention_probs` against the
//! naive formula and finite differences.

mod common;

use std::time::Duration;

use common::attention::{composed, gqa_dims, nz, repeated, GqaDims};
use common::{
    assert_grad_matches_fd, nd_sbp, on_ranks, placement, small_meshes_either_way, vals,
    weighted_sum, Tol,
};
use ndarray::{ArrayD, IxDyn};
use oxiflow_ops::attention::{attention, flash_attention, flash_attention_lse};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Sbp, Tensor, TensorError};
use proptest::prelude::*;

const F: DType = DType::F64;

fn arr(x: &Tensor) -> ArrayD<f64> {
    x.cast(F).unwrap().to_ndarray::<f64>().unwrap()
}

/// The softmax of query row `i` over the keys it sees (all `s`, the first `i + 1` when
/// `causal`) of the scores `scale * sum_e qk(j, e)` (key `j`, head element `e`), and the row's
/// log-sum-exp.
fn softmax_row(
    (i, s, causal): (usize, usize, bool),
    d: usize,
    scale: f64,
    qk: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, f64) {
    let live = if causal { i + 1 } else { s };
    let sc: Vec<f64> = (0..live)
        .map(|j| scale * (0..d).map(|e| qk(j, e)).sum::<f64>())
        .collect();
    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
    (sc.iter().map(|x| (x - m).exp() / z).collect(), m + z.ln())
}

/// The naive formula on `[B, T, H, D]` operands: o `[B, T, H, Dv]`, lse `[B, H, T]` and, for
/// the output gradient `d_o`, dq, dk, dv.
struct Naive {
    o: ArrayD<f64>,
    lse: ArrayD<f64>,
    grads: [ArrayD<f64>; 3],
}

fn naive(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, causal: bool, scale: f64) -> Naive {
    let (q, k, v, g) = (arr(q), arr(k), arr(v), arr(d_o));
    let (b, t, h, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (s, dv) = (k.shape()[1], v.shape()[3]);
    let mut o = ArrayD::<f64>::zeros(IxDyn(&[b, t, h, dv]));
    let mut lse = ArrayD::<f64>::zeros(IxDyn(&[b, h, t]));
    let mut dq = ArrayD::<f64>::zeros(IxDyn(&[b, t, h, d]));
    let mut dk = ArrayD::<f64>::zeros(IxDyn(&[b, s, h, d]));
    let mut dvv = ArrayD::<f64>::zeros(IxDyn(&[b, s, h, dv]));
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..t {
                let (p, row_lse) = softmax_row((i, s, causal), d, scale, |j, e| {
                    q[[bi, i, hi, e]] * k[[bi, j, hi, e]]
                });
                lse[[bi, hi, i]] = row_lse;
                let live = p.len();
                for e in 0..dv {
                    o[[bi, i, hi, e]] = (0..live).map(|j| p[j] * v[[bi, j, hi, e]]).sum();
                }
                let dp: Vec<f64> = (0..live)
                    .map(|j| (0..dv).map(|e| g[[bi, i, hi, e]] * v[[bi, j, hi, e]]).sum())
                    .collect();
                let c: f64 = (0..live).map(|j| p[j] * dp[j]).sum();
                for j in 0..live {
                    let ds = p[j] * (dp[j] - c) * scale;
                    for e in 0..d {
                        dq[[bi, i, hi, e]] += ds * k[[bi, j, hi, e]];
                        dk[[bi, j, hi, e]] += ds * q[[bi, i, hi, e]];
                    }
                    for e in 0..dv {
                        dvv[[bi, j, hi, e]] += p[j] * g[[bi, i, hi, e]];
                    }
                }
            }
        }
    }
    Naive {
        o,
        lse,
        grads: [dq, dk, dvv],
    }
}

fn assert_near(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let ok = (a - b).abs() <= tol * (1.0 + b.abs()) || (a.is_infinite() && a == b);
        assert!(ok, "{what}: element {i}: {a} vs {b}");
    }
}

fn flat(a: &ArrayD<f64>) -> Vec<f64> {
    a.iter().copied().collect()
}

/// (o, lse, [dq, dk, dv]) of the op for the loss sum(o * r), at `dtype`.
fn run_op(
    x: &[Tensor; 3],
    r: &Tensor,
    causal: bool,
    scale: f64,
    dtype: DType,
) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
    let xs: Vec<Tensor> = x
        .iter()
        .map(|t| t.detach().cast(dtype).unwrap().requires_grad_(true))
        .collect();
    let (o, lse) = flash_attention_lse(&xs[0], &xs[1], &xs[2], causal, scale).unwrap();
    assert_eq!(o.dtype(), dtype);
    assert_eq!(lse.dtype(), dtype.compute());
    o.mul(&r.cast(dtype).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grads = xs.iter().map(|t| vals(&t.grad().unwrap())).collect();
    (vals(&o), vals(&lse), grads)
}

#[test]
fn flash_matches_the_naive_formula_over_blocks() {
    // (B, T, S, H, D, Dv, causal): one block, several query and key blocks (64 each), S != T,
    // Dv != D, large enough for the parallel path.
    for (case, &(b, t, s, h, d, dv, causal)) in [
        (2, 4, 4, 3, 5, 5, true),
        (1, 3, 6, 2, 4, 2, false),
        (2, 70, 70, 3, 5, 5, true),
        (1, 65, 130, 2, 4, 3, false),
        (1, 129, 129, 1, 3, 3, true),
        (1, 1, 1, 1, 1, 1, true),
    ]
    .iter()
    .enumerate()
    {
        let seed = 10 * case as u64;
        let x = [
            nz(&[b, t, h, d], seed),
            nz(&[b, s, h, d], seed + 1),
            nz(&[b, s, h, dv], seed + 2),
        ];
        let r = nz(&[b, t, h, dv], seed + 3);
        let scale = 1.0 / (d as f64).sqrt();
        let want = naive(&x[0], &x[1], &x[2], &r, causal, scale);
        let what = format!("case {case}");
        let (o, lse, g) = run_op(&x, &r, causal, scale, F);
        assert_near(&o, &flat(&want.o), 1e-12, &format!("{what}: o"));
        assert_near(&lse, &flat(&want.lse), 1e-12, &format!("{what}: lse"));
        for (i, (gi, wi)) in g.iter().zip(&want.grads).enumerate() {
            assert_near(gi, &flat(wi), 1e-11, &format!("{what}: grad {i}"));
        }
        let (o, lse, g) = run_op(&x, &r, causal, scale, DType::F32);
        assert_near(&o, &flat(&want.o), 2e-5, &format!("{what}: f32 o"));
        assert_near(&lse, &flat(&want.lse), 2e-5, &format!("{what}: f32 lse"));
        for (i, (gi, wi)) in g.iter().zip(&want.grads).enumerate() {
            assert_near(gi, &flat(wi), 1e-4, &format!("{what}: f32 grad {i}"));
        }
    }
}

#[test]
fn flash_equals_the_composed_reference_with_its_gradients() {
    for causal in [false, true] {
        let s = if causal { 7 } else { 9 };
        let x = [
            nz(&[2, 7, 3, 4], 1).requires_grad_(true),
            nz(&[2, s, 3, 4], 2).requires_grad_(true),
            nz(&[2, s, 3, 5], 3).requires_grad_(true),
        ];
        let r = nz(&[2, 7, 3, 5], 4);
        let y = composed(&x[0], &x[1], &x[2], causal, 0.6);
        weighted_sum(&y, &r).backward().unwrap();
        let want_g: Vec<Vec<f64>> = x.iter().map(|t| vals(&t.grad().unwrap())).collect();
        let (o, _, g) = run_op(&x.clone().map(|t| t.detach()), &r, causal, 0.6, F);
        assert_near(&o, &vals(&y), 1e-12, "o");
        for (i, (gi, wi)) in g.iter().zip(&want_g).enumerate() {
            assert_near(gi, wi, 1e-11, &format!("grad {i}"));
        }
    }
}

#[test]
fn sixteen_bit_operands_compute_in_f32_and_round_once() {
    // 2 heads over 2 key/value heads, and 6 over 2 (grouped).
    for (h, g, dtype) in [
        (2, 2, DType::BF16),
        (2, 2, DType::F16),
        (6, 2, DType::BF16),
        (6, 2, DType::F16),
    ] {
        let x = [
            nz(&[2, 9, h, 8], 5),
            nz(&[2, 9, g, 8], 6),
            nz(&[2, 9, g, 8], 7),
        ];
        let h: Vec<Tensor> = x.iter().map(|t| t.cast(dtype).unwrap()).collect();
        let wide: Vec<Tensor> = h.iter().map(|t| t.cast(DType::F32).unwrap()).collect();
        let (o, lse) = flash_attention_lse(&h[0], &h[1], &h[2], true, 0.35).unwrap();
        let (wo, wlse) = flash_attention_lse(&wide[0], &wide[1], &wide[2], true, 0.35).unwrap();
        assert_eq!((o.dtype(), lse.dtype()), (dtype, DType::F32));
        assert_eq!(vals(&o), vals(&wo.cast(dtype).unwrap()), "{dtype} o");
        assert_eq!(vals(&lse), vals(&wlse), "{dtype} lse");
    }
}

#[test]
fn edge_shapes() {
    // No keys: zero outputs, lse -inf, zero dq.
    let q = nz(&[2, 4, 3, 5], 1).requires_grad_(true);
    let k = Tensor::randn([2, 0, 3, 5], 2, F).requires_grad_(true);
    let v = Tensor::randn([2, 0, 3, 2], 3, F).requires_grad_(true);
    let (o, lse) = flash_attention_lse(&q, &k, &v, false, 1.0).unwrap();
    assert_eq!(o.shape().dims(), [2, 4, 3, 2]);
    assert!(vals(&o).iter().all(|&x| x == 0.0));
    assert!(vals(&lse).iter().all(|&x| x == f64::NEG_INFINITY));
    o.sum_all().unwrap().backward().unwrap();
    assert!(vals(&q.grad().unwrap()).iter().all(|&x| x == 0.0));
    assert_eq!(k.grad().unwrap().shape().dims(), [2, 0, 3, 5]);
    // No batch, no queries, no heads.
    for (qs, ks) in [
        ([0, 4, 3, 5], [0, 4, 3, 5]),
        ([2, 0, 3, 5], [2, 6, 3, 5]),
        ([2, 4, 0, 5], [2, 4, 0, 5]),
    ] {
        let (q, k) = (Tensor::randn(qs, 1, F), Tensor::randn(ks, 2, F));
        let (o, lse) = flash_attention_lse(&q, &k, &k, false, 1.0).unwrap();
        assert_eq!(o.shape().dims(), qs);
        assert_eq!(lse.shape().dims(), [qs[0], qs[2], qs[1]]);
    }
}

#[test]
fn lse_is_a_statistic_and_only_needed_inputs_get_gradients() {
    let q = nz(&[1, 3, 2, 2], 1);
    let k = nz(&[1, 3, 2, 2], 2);
    let v = nz(&[1, 3, 2, 2], 3).requires_grad_(true);
    let (o, lse) = flash_attention_lse(&q, &k, &v, true, 0.7).unwrap();
    assert!(o.requires_grad() && !lse.requires_grad());
    let r = nz(&[1, 3, 2, 2], 4);
    weighted_sum(&o, &r).backward().unwrap();
    assert!(q.grad().is_none() && k.grad().is_none());
    let want = naive(&q, &k, &v, &r, true, 0.7);
    assert_near(
        &vals(&v.grad().unwrap()),
        &flat(&want.grads[2]),
        1e-12,
        "dv",
    );
}

#[test]
fn bad_shapes_and_dtypes_are_typed_errors() {
    let t = |s: &[usize]| Tensor::randn(s.to_vec(), 1, F);
    let q = t(&[2, 4, 3, 5]);
    let shape_err = |r: oxiflow_tensor::Result<Tensor>, what: &str| match r {
        Err(TensorError::Shape { op, detail, .. }) => {
            assert_eq!(op, "flash_attention", "{what}");
            assert!(!detail.is_empty());
        }
        other => panic!("{what}: expected a shape error, got {other:?}"),
    };
    shape_err(flash_attention(&t(&[4, 3, 5]), &q, &q, false, 1.0), "3-d q");
    shape_err(
        flash_attention(&q, &t(&[2, 4, 3, 6]), &q, false, 1.0),
        "k with another D",
    );
    shape_err(
        flash_attention(&q, &t(&[2, 4, 2, 5]), &q, false, 1.0),
        "k with another H",
    );
    shape_err(
        flash_attention(&q, &t(&[1, 4, 3, 5]), &q, false, 1.0),
        "k with another B",
    );
    shape_err(
        flash_attention(&q, &q, &t(&[2, 5, 3, 5]), false, 1.0),
        "v with another S",
    );
    shape_err(flash_attention(&q, &q, &t(&[2, 4, 3]), false, 1.0), "3-d v");
    let k6 = t(&[2, 6, 3, 5]);
    shape_err(
        flash_attention(&q, &k6, &k6, true, 1.0),
        "causal with S != T",
    );
    shape_err(flash_attention(&q, &q, &q, false, f64::NAN), "NaN scale");
    shape_err(
        flash_attention(&q, &q, &q, false, f64::INFINITY),
        "infinite scale",
    );
    let q0 = t(&[2, 4, 3, 0]);
    shape_err(flash_attention(&q0, &q0, &q0, false, 1.0), "head size 0");
    assert!(flash_attention(&q, &k6, &k6, false, 1.0).is_ok());
    let dtype_err = |r: oxiflow_tensor::Result<Tensor>, what: &str| match r {
        Err(
            e @ TensorError::DType {
                op: "flash_attention",
                ..
            },
        ) => {
            let TensorError::DType { dtypes, .. } = &e else {
                unreachable!()
            };
            assert!(!dtypes.is_empty(), "{what}: {e}");
            let text = e.to_string();
            assert!(text.contains("flash_attention"), "{what}: {text}");
        }
        other => panic!("{what}: expected a dtype error, got {other:?}"),
    };
    let q32 = q.cast(DType::F32).unwrap();
    dtype_err(flash_attention(&q, &q32, &q, false, 1.0), "mixed dtypes");
    let qb = q.cast(DType::BF16).unwrap();
    dtype_err(flash_attention(&q, &q, &qb, false, 1.0), "f64 with bf16");
    let qi = q.cast(DType::I64).unwrap();
    dtype_err(flash_attention(&qi, &qi, &qi, false, 1.0), "i64");
    let named = flash_attention(&qi, &qi, &qi, false, 1.0)
        .unwrap_err()
        .to_string();
    assert!(named.contains("i64"), "the dtype is named: {named}");
}

#[test]
fn batch_and_head_splits_stay_split() {
    // B = 3 and H = 3 over 2 ranks: uneven splits; neither the inputs nor the outputs move.
    let got = run_ranks(2, Duration::from_secs(30), |_| {
        let p = placement(&[2], 0);
        let mut sbps = Vec::new();
        for sbp in [Sbp::S(0), Sbp::S(2), Sbp::B] {
            let x =
                |seed| Tensor::randn_global([3, 4, 3, 2], seed, F, &p, NdSbp::new([sbp])).unwrap();
            let (o, lse) = flash_attention_lse(&x(1), &x(2), &x(3), true, 0.5).unwrap();
            sbps.push((o.nd_sbp().cloned(), lse.nd_sbp().cloned()));
        }
        sbps
    });
    let one = |s| Some(NdSbp::new([s]));
    for sbps in got {
        assert_eq!(
            sbps,
            vec![
                (one(Sbp::S(0)), one(Sbp::S(0))),
                (one(Sbp::S(2)), one(Sbp::S(1))),
                (one(Sbp::B), one(Sbp::B)),
            ]
        );
    }
}

#[test]
fn heads_first_attention_equals_the_composed_reference_on_a_2d_mesh() {
    // q, k, v [B, H, T, D] = [3, 3, 5, 3] (odd T and D), batch split on mesh axis 0 and heads
    // on axis 1 (uneven: 3 over 2): value and gradients equal one rank's f64 composition.
    let shape = [3usize, 3, 5, 3];
    let heads_last = |x: &Tensor| x.permute(&[0, 2, 1, 3]).unwrap();
    let local: Vec<Tensor> = (0..3)
        .map(|i| nz(&shape, 40 + i).requires_grad_(true))
        .collect();
    let r = nz(&shape, 44);
    let want = heads_last(&composed(
        &heads_last(&local[0]),
        &heads_last(&local[1]),
        &heads_last(&local[2]),
        true,
        0.45,
    ));
    weighted_sum(&want, &r).backward().unwrap();
    let want_g: Vec<Vec<f64>> = local.iter().map(|x| vals(&x.grad().unwrap())).collect();
    let want = vals(&want);
    let got = run_ranks(4, Duration::from_secs(30), |_| {
        let p = placement(&[2, 2], 3);
        let split = NdSbp::new([Sbp::S(0), Sbp::S(1)]);
        let bc = NdSbp::broadcast(2);
        let xs: Vec<Tensor> = local
            .iter()
            .map(|x| {
                x.detach()
                    .to_global(&p, bc.clone())
                    .and_then(|g| g.to_global(&p, split.clone()))
                    .unwrap()
                    .detach()
                    .requires_grad_(true)
            })
            .collect();
        let y = attention(&xs[0], &xs[1], &xs[2], true, 0.45).unwrap();
        let sbp = y.nd_sbp().cloned();
        let r = r.to_global(&p, bc.clone()).unwrap();
        weighted_sum(&y, &r).backward().unwrap();
        let all = |x: &Tensor| vals(&x.to_global(&p, bc.clone()).unwrap());
        let g: Vec<Vec<f64>> = xs.iter().map(|x| all(&x.grad().unwrap())).collect();
        (sbp, all(&y), g)
    });
    for (sbp, y, g) in got {
        assert_eq!(sbp, Some(NdSbp::new([Sbp::S(0), Sbp::S(1)])));
        assert_near(&y, &want, 1e-12, "o");
        for (i, (gi, wi)) in g.iter().zip(&want_g).enumerate() {
            assert_near(gi, wi, 1e-11, &format!("grad {i}"));
        }
    }
    let bad = local[0].reshape([9, 5, 3]).unwrap();
    assert!(matches!(
        attention(&bad, &local[1], &local[2], true, 0.45),
        Err(TensorError::Shape {
            op: "attention",
            ..
        })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn global_layouts_equal_the_composed_reference(
        dims in gqa_dims(1..4, 1..5, 1..5, 1..4, 1..3, 1..4),
        mesh in small_meshes_either_way(),
        sbp_seeds: [u64; 3],
        perm_seed: u64,
    ) {
        // H = group x G query heads over G key/value heads (group 1: multi-head).
        let GqaDims { b, t, s, g, group, d, causal } = dims;
        let h = dims.h();
        let p = placement(&mesh, perm_seed);
        let sbps: Vec<NdSbp> = sbp_seeds.iter().map(|&z| nd_sbp(mesh.len(), 4, z, true)).collect();
        let shapes = [vec![b, t, h, d], vec![b, s, g, d], vec![b, s, g, d + 1]];
        let r_shape = vec![b, t, h, d + 1];
        let local: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, sh)| Tensor::randn(sh.clone(), 20 + i as u64, F).requires_grad_(true))
            .collect();
        let r = Tensor::randn(r_shape.clone(), 30, F);
        let (k, v) = (repeated(&local[1], group), repeated(&local[2], group));
        let want_y = composed(&local[0], &k, &v, causal, 0.6);
        weighted_sum(&want_y, &r).backward().unwrap();
        let want_g: Vec<Vec<f64>> = local.iter().map(|x| vals(&x.grad().unwrap())).collect();
        let want_lse = flat(&naive(&local[0], &k, &v, &r, causal, 0.6).lse);
        let want_y = vals(&want_y);
        let got = on_ranks(&p, |_| {
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
            let all = |x: &Tensor| vals(&x.to_global(&p, bc.clone()).unwrap());
            let (y, lse) = flash_attention_lse(&xs[0], &xs[1], &xs[2], causal, 0.6).unwrap();
            weighted_sum(&y, &r).backward().unwrap();
            let g: Vec<Vec<f64>> = xs.iter().map(|x| all(&x.grad().unwrap())).collect();
            (all(&y), all(&lse), g)
        });
        for (y, lse, g) in got {
            for (a, w) in y.iter().zip(&want_y) {
                prop_assert!((a - w).abs() < 1e-10 * (1.0 + w.abs()), "y: {a} vs {w}");
            }
            for (a, w) in lse.iter().zip(&want_lse) {
                prop_assert!((a - w).abs() < 1e-10 * (1.0 + w.abs()), "lse: {a} vs {w}");
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

/// Naive attention probabilities `[B, H, T, S]` of q `[B, H, T, D]`, k `[B, H, S, D]`.
fn naive_probs(q: &Tensor, k: &Tensor, causal: bool, scale: f64) -> Vec<f64> {
    let (q, k) = (arr(q), arr(k));
    let (b, h, t, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let s = k.shape()[2];
    let mut probs = Vec::new();
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..t {
                let (p, _) = softmax_row((i, s, causal), d, scale, |j, e| {
                    q[[bi, hi, i, e]] * k[[bi, hi, j, e]]
                });
                probs.extend((0..s).map(|j| p.get(j).copied().unwrap_or(0.0)));
            }
        }
    }
    probs
}

#[test]
fn probs_match_the_naive_formula() {
    for (case, &(b, h, t, s, d, causal)) in [
        (2, 3, 4, 4, 5, true),
        (1, 2, 3, 6, 4, false),
        (3, 1, 5, 5, 2, true),
    ]
    .iter()
    .enumerate()
    {
        let q = nz(&[b, h, t, d], 10 * case as u64);
        let k = nz(&[b, h, s, d], 10 * case as u64 + 1);
        let scale = 1.0 / (d as f64).sqrt();
        let p = q.attention_probs(&k, causal, scale).unwrap();
        assert_eq!(p.shape().dims(), [b, h, t, s]);
        assert_near(
            &vals(&p),
            &naive_probs(&q, &k, causal, scale),
            1e-12,
            "attention_probs",
        );
    }
    let q = Tensor::randn([2, 3, 4, 5], 1, F);
    let p = q
        .attention_probs(&Tensor::randn([2, 3, 0, 5], 2, F), false, 1.0)
        .unwrap();
    assert_eq!(p.shape().dims(), [2, 3, 4, 0]);
}

/// sum(attention_probs(q, k) * r).
fn probs_loss(q: &Tensor, k: &Tensor, r: &Tensor, causal: bool) -> Tensor {
    weighted_sum(&q.attention_probs(k, causal, 0.7).unwrap(), r)
}

#[test]
fn probs_gradients_match_finite_differences() {
    for causal in [false, true] {
        let s = if causal { 3 } else { 4 };
        let q = Tensor::randn([1, 2, 3, 2], 7, F).requires_grad_(true);
        let k = Tensor::randn([1, 2, s, 2], 8, F).requires_grad_(true);
        let r = Tensor::randn([1, 2, 3, s], 9, F);
        probs_loss(&q, &k, &r, causal).backward().unwrap();
        let (qd, kd, tol) = (q.detach(), k.detach(), Tol::Rel(1e-6));
        let loss_q = |q: &Tensor| probs_loss(q, &kd, &r, causal);
        assert_grad_matches_fd(&q, &q.grad().unwrap(), tol, loss_q, "input 0");
        let loss_k = |k: &Tensor| probs_loss(&qd, k, &r, causal);
        assert_grad_matches_fd(&k, &k.grad().unwrap(), tol, loss_k, "input 1");
    }
}

#[test]
fn probs_bad_input_is_a_typed_error() {
    let t = |s: &[usize]| Tensor::randn(s.to_vec(), 1, F);
    let q = t(&[2, 3, 4, 5]);
    for (r, what) in [
        (
            q.attention_probs(&t(&[2, 3, 6, 5]), true, 1.0),
            "causal probs with S != T",
        ),
        (
            q.attention_probs(&t(&[2, 3, 4, 6]), false, 1.0),
            "k with another D",
        ),
        (q.attention_probs(&q, false, f64::NAN), "NaN scale"),
    ] {
        assert!(matches!(r, Err(TensorError::Shape { .. })), "{what}: {r:?}");
    }
    let qi = q.cast(DType::I64).unwrap();
    assert!(matches!(
        qi.attention_probs(&qi, false, 1.0),
        Err(TensorError::DType { .. })
    ));
}
