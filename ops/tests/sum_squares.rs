//! The multi-tensor sum of squares against an f64 reference: local tensors of every float
//! dtype (and typed errors), then tensors in random layouts (S on any dim, B, P; uneven and
//! empty shards; 0-d tensors; 1-d and 2-d meshes, permuted ranks) summed in one call and in the
//! split-or-not groups the gradient norm uses, with the `x * 0` form finding non-finite
//! tensors; every rank reads the same bits.

mod common;

use std::time::Duration;

use common::{nd_sbp, placement};
use oxiflow_ops::sum_squares::{non_finite_sums, sum_squares_multi};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Sbp, Tensor};
use proptest::prelude::*;

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

/// The values of `t` (global: read whole) as f64.
fn vals(t: &Tensor) -> Vec<f64> {
    let t = match t.placement() {
        Some(p) => t.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
        None => t.clone(),
    };
    t.cast(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// The f64 sum of each tensor's squares, each rounded to f32 (f64 for f64 tensors).
fn reference(ts: &[Tensor]) -> Vec<f64> {
    ts.iter()
        .map(|t| {
            let wide = t.dtype() == DType::F64;
            vals(t)
                .iter()
                .map(|&x| {
                    if wide {
                        x * x
                    } else {
                        f64::from((x as f32) * (x as f32))
                    }
                })
                .sum()
        })
        .collect()
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-12 * (1.0 + want.abs())
}

#[test]
fn local_tensors_of_every_float_dtype_equal_the_f64_sums() {
    let shapes: [&[usize]; 5] = [&[7, 3], &[0, 4], &[], &[50_000], &[2, 3, 5]];
    let ts: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            DTYPES.map(|d| {
                Tensor::randn(s.to_vec(), 10 + i as u64, d)
                    .mul_scalar(3.0)
                    .unwrap()
            })
        })
        .collect();
    let refs: Vec<&Tensor> = ts.iter().collect();
    let sums = sum_squares_multi(&refs).unwrap();
    assert_eq!(sums.each.shape().dims(), &[ts.len()]);
    assert_eq!(
        (sums.each.dtype(), sums.total.dtype()),
        (DType::F64, DType::F64)
    );
    let each = vals(&sums.each);
    let want = reference(&ts);
    for (i, (g, w)) in each.iter().zip(&want).enumerate() {
        assert!(close(*g, *w), "tensor {i}: {g} vs {w}");
    }
    let total = vals(&sums.total)[0];
    assert!(close(total, want.iter().sum()), "{total}");
    // Deterministic: the same bits again.
    let again = sum_squares_multi(&refs).unwrap();
    assert_eq!(vals(&again.total)[0].to_bits(), total.to_bits());
    // Finite values whose squares overflow f32 make the sum infinite (as they would make
    // AdamW's second moment), but not an f64 one; x * 0 is 0 for them.
    let big = Tensor::from_vec(vec![3e19f32, -1.0], [2]).unwrap();
    let s = sum_squares_multi(&[&big, &big.cast(DType::F64).unwrap()]).unwrap();
    let each = vals(&s.each);
    assert_eq!(each[0], f64::INFINITY);
    assert!(close(each[1], (3e19f32 as f64).powi(2) + 1.0), "{each:?}");
    assert_eq!(vals(&non_finite_sums(&[&big]).unwrap().each), vec![0.0]);
}

#[test]
fn non_finite_tensors_give_nan_and_finite_ones_zero() {
    let ok = Tensor::randn([4, 3], 1, DType::F32);
    let nan = Tensor::from_vec(vec![1.0f32, f32::NAN], [2]).unwrap();
    let inf = Tensor::from_vec(vec![f64::NEG_INFINITY], [1]).unwrap();
    let h = Tensor::from_vec(vec![1.0f32, f32::INFINITY], [2])
        .unwrap()
        .cast(DType::BF16)
        .unwrap();
    let flags = vals(&non_finite_sums(&[&ok, &nan, &inf, &h]).unwrap().each);
    assert_eq!(flags[0], 0.0);
    assert!(flags[1..].iter().all(|f| f.is_nan()), "{flags:?}");
    let sums = sum_squares_multi(&[&ok, &inf]).unwrap();
    assert_eq!(vals(&sums.total)[0], f64::INFINITY);
}

#[test]
fn integer_inputs_are_typed_errors() {
    let x = Tensor::randn([3], 1, DType::F32);
    let ids = Tensor::from_vec(vec![1i64, 2], [2]).unwrap();
    let e = sum_squares_multi(&[&x, &ids]).unwrap_err().to_string();
    assert!(e.contains("sum_squares") && e.contains("i64"), "{e}");
    let e = sum_squares_multi(&[]).unwrap_err().to_string();
    assert!(e.contains("sum_squares"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Tensors in random layouts on one placement: the sums in one call (the engine boxes what
    /// the candidates need) and per split-or-not group (whose sums are partial exactly on the
    /// split axes) equal the f64 reference on every rank, bit-equal across ranks.
    #[test]
    fn sums_over_any_layouts_equal_the_f64_reference(
        dims in proptest::collection::vec(proptest::collection::vec(0usize..5, 0..3), 1..6),
        mesh in prop::sample::select(vec![vec![2usize], vec![3], vec![2, 2], vec![1, 3]]),
        seeds in proptest::collection::vec(any::<u64>(), 8),
        poison in 0usize..8,
    ) {
        let p = placement(&mesh, seeds[0]);
        let n: usize = mesh.iter().product();
        let locals: Vec<Tensor> = dims
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let x = Tensor::randn(s.clone(), seeds[1] ^ i as u64, DTYPES[(seeds[2] as usize + i) % 4]);
                // Poisoned tensors hold an infinity (when they have elements).
                if i == poison && x.numel() > 0 {
                    let mut v = vals(&x);
                    v[0] = f64::INFINITY;
                    Tensor::from_vec(v, s.clone()).unwrap().cast(x.dtype()).unwrap()
                } else {
                    x
                }
            })
            .collect();
        let want = reference(&locals);
        let layouts: Vec<NdSbp> = dims
            .iter()
            .enumerate()
            .map(|(i, s)| nd_sbp(p.ndim(), s.len(), seeds[3] ^ (i as u64 * 77), true))
            .collect();
        let got = run_ranks(n, Duration::from_secs(60), |_| {
            let gs: Vec<Tensor> = locals
                .iter()
                .zip(&layouts)
                .map(|(x, nd)| {
                    x.to_global(&p, NdSbp::broadcast(p.ndim()))
                        .unwrap()
                        .to_global(&p, nd.clone())
                        .unwrap()
                })
                .collect();
            let refs: Vec<&Tensor> = gs.iter().collect();
            let all = sum_squares_multi(&refs).unwrap();
            let flags = non_finite_sums(&refs).unwrap();
            // Per group, as the gradient norm calls it.
            let mut grouped = vec![f64::NAN; gs.len()];
            let mut pending: Vec<usize> = (0..gs.len()).collect();
            while let Some(&first) = pending.first() {
                let key = |j: &usize| {
                    layouts[*j].iter().map(|s| matches!(s, Sbp::Split(_))).collect::<Vec<_>>()
                };
                let k0 = key(&first);
                let (members, rest): (Vec<usize>, Vec<usize>) =
                    pending.iter().partition(|j| key(j) == k0);
                let group: Vec<&Tensor> = members.iter().map(|&j| &gs[j]).collect();
                let s = sum_squares_multi(&group).unwrap();
                // Partial on the split axes; broadcast where every member is broadcast (a
                // partial member may be reduce-scattered instead of all-reduced).
                let out = s.each.nd_sbp().unwrap().clone();
                for a in 0..p.ndim() {
                    let of = |j: &usize| layouts[*j].as_slice()[a];
                    if matches!(of(&first), Sbp::Split(_)) {
                        assert_eq!(out.as_slice()[a], Sbp::P, "axis {a} of {out}");
                    } else if members.iter().all(|j| of(j) == Sbp::B) {
                        assert_eq!(out.as_slice()[a], Sbp::B, "axis {a} of {out}");
                    }
                }
                for (k, v) in vals(&s.each).into_iter().enumerate() {
                    grouped[members[k]] = v;
                }
                pending = rest;
            }
            (vals(&all.each), vals(&all.total)[0], grouped, vals(&flags.each))
        });
        let total: f64 = want.iter().sum();
        for (rank, (each, t, grouped, flags)) in got.iter().enumerate() {
            for (i, w) in want.iter().enumerate() {
                prop_assert!(close(each[i], *w) || (w.is_infinite() && each[i] == *w), "rank {rank} tensor {i}: {} vs {w}", each[i]);
                prop_assert!(close(grouped[i], *w) || (w.is_infinite() && grouped[i] == *w), "rank {rank} grouped {i}: {} vs {w}", grouped[i]);
                prop_assert_eq!(flags[i].is_nan(), w.is_infinite(), "rank {} flag {}", rank, i);
            }
            prop_assert!(close(*t, total) || (total.is_infinite() && *t == total), "rank {rank} total {t} vs {total}");
            prop_assert_eq!(t.to_bits(), got[0].1.to_bits(), "rank {} reads other bits", rank);
        }
    }
}
