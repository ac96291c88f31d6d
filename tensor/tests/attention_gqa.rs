//! Grouped-query attention in the fused `flash_attention` op: q `[B, T, H, D]` with k, v
//! `[B, S, G, D]` (H = group x G, query head `h` reading key/value head `h / group`) against
//! the f64 reference on key/value heads repeated to H (the composed `attention_probs` + `bmm`
//! for o and the gradients, which sum over each group's copies; multi-head `flash_attention`
//! for lse), G = 1 and G = H included: on one rank (f64, f32), and a heads split, which stays
//! split only when it splits the key/value heads into whole groups (every global layout and
//! 16-bit operands: `attention.rs`).

mod common;

use std::time::Duration;

use common::attention::{composed, gqa_dims, nz, repeated, GqaDims};
use common::{placement, vals, weighted_sum};
use oxiflow_ops::attention::{flash_attention, flash_attention_lse};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Sbp, Tensor, TensorError};
use proptest::prelude::*;

const F: DType = DType::F64;

/// The reference's o, lse and [dq, dk, dv] for the loss sum(o * r).
struct Want {
    o: Vec<f64>,
    lse: Vec<f64>,
    grads: Vec<Vec<f64>>,
}

fn reference(x: &[Tensor; 3], r: &Tensor, group: usize, causal: bool, scale: f64) -> Want {
    let xs: Vec<Tensor> = x
        .iter()
        .map(|t| t.detach().cast(F).unwrap().requires_grad_(true))
        .collect();
    let (k, v) = (repeated(&xs[1], group), repeated(&xs[2], group));
    let o = composed(&xs[0], &k, &v, causal, scale);
    weighted_sum(&o, &r.cast(F).unwrap()).backward().unwrap();
    let (_, lse) =
        flash_attention_lse(&xs[0].detach(), &k.detach(), &v.detach(), causal, scale).unwrap();
    Want {
        o: vals(&o),
        lse: vals(&lse),
        grads: xs.iter().map(|t| vals(&t.grad().unwrap())).collect(),
    }
}

/// The op's o, lse and [dq, dk, dv] at `dtype`.
fn run_op(x: &[Tensor; 3], r: &Tensor, causal: bool, scale: f64, dtype: DType) -> Want {
    let xs: Vec<Tensor> = x
        .iter()
        .map(|t| t.detach().cast(dtype).unwrap().requires_grad_(true))
        .collect();
    let (o, lse) = flash_attention_lse(&xs[0], &xs[1], &xs[2], causal, scale).unwrap();
    assert_eq!(o.shape().dims(), r.shape().dims());
    weighted_sum(&o, &r.cast(dtype).unwrap())
        .backward()
        .unwrap();
    Want {
        o: vals(&o),
        lse: vals(&lse),
        grads: xs.iter().map(|t| vals(&t.grad().unwrap())).collect(),
    }
}

fn near(got: &[f64], want: &[f64], tol: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("lengths {} vs {}", got.len(), want.len()));
    }
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let ok = (a - b).abs() <= tol * (1.0 + b.abs()) || (a.is_infinite() && a == b);
        if !ok {
            return Err(format!("element {i}: {a} vs {b}"));
        }
    }
    Ok(())
}

fn all_near(got: &Want, want: &Want, tol: f64) -> Result<(), String> {
    near(&got.o, &want.o, tol).map_err(|e| format!("o: {e}"))?;
    near(&got.lse, &want.lse, tol).map_err(|e| format!("lse: {e}"))?;
    for (i, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
        near(g, w, 10.0 * tol).map_err(|e| format!("grad {i}: {e}"))?;
    }
    Ok(())
}

/// q, k, v and the output weights of one case.
fn operands(dims: [usize; 7], seed: u64) -> ([Tensor; 3], Tensor) {
    let [b, t, s, g, group, d, dv] = dims;
    let h = g * group;
    let x = [
        nz(&[b, t, h, d], seed),
        nz(&[b, s, g, d], seed + 1),
        nz(&[b, s, g, dv], seed + 2),
    ];
    (x, nz(&[b, t, h, dv], seed + 3))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn grouped_heads_equal_repeated_heads_on_one_rank(
        dims in gqa_dims(1..3, 1..80, 1..80, 1..4, 1..5, 1..6),
        dv in 1usize..6,
        seed in 0u64..1000,
    ) {
        let GqaDims { b, t, s, g, group, d, causal } = dims;
        let (x, r) = operands([b, t, s, g, group, d, dv], seed);
        let scale = 1.0 / (d as f64).sqrt();
        let want = reference(&x, &r, group, causal, scale);
        all_near(&run_op(&x, &r, causal, scale, F), &want, 1e-12)
            .map_err(|e| TestCaseError::fail(format!("f64: {e}")))?;
        all_near(&run_op(&x, &r, causal, scale, DType::F32), &want, 2e-5)
            .map_err(|e| TestCaseError::fail(format!("f32: {e}")))?;
    }
}

#[test]
fn a_heads_split_stays_split_only_over_whole_groups() {
    // H = 4 query heads over G = 2 kv heads on 2 ranks: one group each, nothing moves. H = 6
    // over G = 3 on 2 ranks: no split of whole groups, so the op runs on another layout (and
    // still equals one rank).
    for (g, stays) in [(2usize, true), (3, false)] {
        let (x, r) = operands([2, 5, 5, g, 2, 3, 3], 70);
        let want = reference(&x, &r, 2, true, 0.5);
        let got = run_ranks(2, Duration::from_secs(30), |_| {
            let p = placement(&[2], 0);
            let split = NdSbp::new([Sbp::S(2)]);
            let bc = NdSbp::broadcast(1);
            let xs: Vec<Tensor> = x
                .iter()
                .map(|t| {
                    t.to_global(&p, bc.clone())
                        .and_then(|w| w.to_global(&p, split.clone()))
                        .unwrap()
                        .detach()
                        .requires_grad_(true)
                })
                .collect();
            let (y, lse) = flash_attention_lse(&xs[0], &xs[1], &xs[2], true, 0.5).unwrap();
            let sbp = y.nd_sbp().cloned();
            weighted_sum(&y, &r.to_global(&p, bc.clone()).unwrap())
                .backward()
                .unwrap();
            let all = |x: &Tensor| vals(&x.to_global(&p, bc.clone()).unwrap());
            let w = Want {
                o: all(&y),
                lse: all(&lse),
                grads: xs.iter().map(|x| all(&x.grad().unwrap())).collect(),
            };
            (sbp, w)
        });
        for (sbp, w) in got {
            assert_eq!(
                sbp == Some(NdSbp::new([Sbp::S(2)])),
                stays,
                "G = {g}: {sbp:?}"
            );
            all_near(&w, &want, 1e-12).unwrap_or_else(|e| panic!("G = {g}: {e}"));
        }
    }
}

#[test]
fn heads_that_do_not_form_whole_groups_are_typed_errors() {
    let q = nz(&[1, 4, 6, 2], 1);
    for g in [4usize, 0, 7] {
        let k = Tensor::zeros([1, 4, g, 2], F);
        match flash_attention(&q, &k, &k, true, 1.0) {
            Err(TensorError::Shape { op, detail, .. }) => {
                assert_eq!(op, "flash_attention");
                assert!(detail.contains("multiple"), "G = {g}: {detail}");
            }
            other => panic!("G = {g}: expected a shape error, got {other:?}"),
        }
    }
    let v = Tensor::zeros([1, 4, 2, 2], F);
    let k3 = Tensor::zeros([1, 4, 3, 2], F);
    assert!(matches!(
        flash_attention(&q, &k3, &v, true, 1.0),
        Err(TensorError::Shape { .. })
    ));
}
