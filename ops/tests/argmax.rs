//! The arg-max through the public op contract: the first index of the largest value above
//! -inf (index 0 when none is), against a host scan on rows with ties, NaN and infinities, in
//! every float dtype; the typed errors; and the global property: rows split or broadcast on 1-d
//! and 2-d meshes, the searched dim split (gathered first), give one rank's indices.

mod common;

use std::time::Duration;

use common::{assert_op_error, first_largest, layouts, meshes, nd_sbp, placement};

use oxiflow_ops::argmax::argmax;
use oxiflow_tensor::{run_ranks, DType, NdSbp, Tensor};
use proptest::prelude::*;

fn want(v: &[f64], n: usize) -> Vec<i64> {
    v.chunks(n).map(first_largest).collect()
}

fn ids(t: &Tensor) -> Vec<i64> {
    t.to_ndarray::<i64>().unwrap().iter().copied().collect()
}

/// Values from a small alphabet (many ties) with NaN and infinities mixed in.
fn value() -> impl Strategy<Value = f64> {
    prop_oneof![
        8 => (-3i32..4).prop_map(|k| f64::from(k) * 0.5),
        1 => Just(f64::NAN),
        1 => Just(f64::NEG_INFINITY),
        1 => Just(f64::INFINITY),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn kernel_matches_the_host_scan(
        rows in 0usize..6,
        n in 1usize..12,
        v in prop::collection::vec(value(), 72),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16, DType::F16]),
    ) {
        let v = v[..rows * n].to_vec();
        let x = Tensor::from_vec(v.clone(), [rows, n]).unwrap().cast(dt).unwrap();
        let got = argmax(&x).unwrap();
        prop_assert_eq!(got.dtype(), DType::I64);
        prop_assert_eq!(got.shape().dims(), &[rows][..]);
        prop_assert_eq!(ids(&got), want(&v, n));
    }
}

#[test]
fn rows_of_only_nan_or_minus_infinity_give_index_zero() {
    let v = vec![
        f64::NAN,
        f64::NEG_INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        1.0,
        1.0,
    ];
    let x = Tensor::from_vec(v, [3, 2]).unwrap();
    assert_eq!(ids(&argmax(&x).unwrap()), vec![0, 0, 0]);
    let big = Tensor::randn([3, 50_000], 4, DType::F32);
    let v = big.cast(DType::F64).unwrap().to_vec::<f64>().unwrap();
    assert_eq!(ids(&argmax(&big).unwrap()), want(&v, 50_000));
}

#[test]
fn bad_input_is_a_typed_error() {
    let e = argmax(&Tensor::randn([2, 0], 1, DType::F32)).unwrap_err();
    assert_op_error!(e, Shape, "argmax");
    let e = argmax(&Tensor::randn([], 1, DType::F32)).unwrap_err();
    assert_op_error!(e, Shape, "argmax");
    let ints = Tensor::randn([2, 3], 1, DType::F32)
        .cast(DType::I64)
        .unwrap();
    let e = argmax(&ints).unwrap_err();
    assert_op_error!(e, DType, "argmax");
    let x = Tensor::randn([2, 3], 1, DType::F32).requires_grad_(true);
    assert!(argmax(&x).unwrap().grad_fn_name().is_none());
}

fn global_case(mesh: &[usize], perm: u64, extra: bool, shape: &[usize], seed: u64) {
    let p = placement(mesh, perm);
    let world = p.num_ranks() + usize::from(extra);
    let nd = nd_sbp(p.ndim(), shape.len(), seed, false);
    let n = *shape.last().unwrap();
    let x = Tensor::randn(shape.to_vec(), seed, DType::F64);
    // Ties on purpose: values rounded to halves.
    let v: Vec<f64> = x
        .to_vec::<f64>()
        .unwrap()
        .iter()
        .map(|e| (e * 2.0).round() / 2.0)
        .collect();
    let expect = want(&v, n);
    let results = run_ranks(world, Duration::from_secs(30), |rank| {
        let x = Tensor::from_vec(v.clone(), shape.to_vec())
            .unwrap()
            .to_global(&p, NdSbp::broadcast(p.ndim()))
            .unwrap()
            .to_global(&p, nd.clone())
            .unwrap();
        let y = argmax(&x).unwrap();
        p.contains(rank).then(|| ids(&y))
    });
    for (rank, got) in results.into_iter().enumerate() {
        if let Some(got) = got {
            assert_eq!(
                got, expect,
                "rank {rank}: {mesh:?} on {p}, x {nd}, {shape:?}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, max_shrink_iters: 32, ..ProptestConfig::default() })]
    #[test]
    fn any_layout_equals_one_rank(
        (mesh, perm, extra) in layouts(meshes(4, vec![vec![2, 2], vec![2, 3], vec![1, 3]])),
        shape in prop::collection::vec(1usize..7, 1..=3),
        seed in any::<u64>(),
    ) {
        global_case(&mesh, perm, extra, &shape, seed);
    }
}
