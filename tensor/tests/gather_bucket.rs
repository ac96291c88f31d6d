//! `gather_bucket`: the shards of several tensors gathered over one mesh axis by one
//! collective equal boxing each tensor alone (S(0) -> B), bit for bit (a P axis aside, whose
//! parts may be summed in another order): 1-d and 2-d meshes,
//! either axis, uneven and empty shards, the other axis B, S(0), S(1) or P, f64 and bf16;
//! shards that are no row ranges of the gathered pieces, mixed dtypes and tensors not split on
//! dim 0 are a typed error on every rank before any communication.

mod common;

use std::time::Duration;

use common::{assert_bucket_layouts, bucket_close, bucket_layout, refused_buckets, BucketLayout};
use oxiflow_placement::DeviceType;
use oxiflow_tensor::{
    gather_bucket, gather_fits, run_ranks, DType, NdSbp, Placement, ReduceOp, Sbp, Tensor,
};
use proptest::prelude::*;

const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
struct Case {
    /// Rows may be fewer than members.
    layout: BucketLayout,
    dtype: DType,
}

fn case() -> impl Strategy<Value = Case> {
    (
        bucket_layout(0..9, 1..6),
        prop_oneof![Just(DType::F64), Just(DType::BF16)],
    )
        .prop_map(|(layout, dtype)| Case { layout, dtype })
}

/// Runs `case` on in-process ranks: (per rank) the pieces the bucket gave with their layouts,
/// and the pieces each tensor boxed alone gives, or the bucket's error text.
#[allow(clippy::type_complexity)]
fn run(case: &Case) -> Vec<Result<(Vec<Vec<f64>>, Vec<Vec<f64>>), String>> {
    let l = &case.layout;
    l.on_ranks(|placement, rank| {
        let shards: Vec<Tensor> = l.pieces(placement, rank, Sbp::S(0), |nd, local, seed| {
            // Never zero, so a piece copied from the wrong place shows.
            Tensor::rand(local, seed, DType::F64)
                .add_scalar(0.5)
                .unwrap()
                .to_dtype(case.dtype)
                .unwrap()
                .to_global_checked(placement, nd)
                .unwrap()
        });
        let fits = shards.iter().all(|s| gather_fits(s, l.axis));
        // The whole value on every rank (a P axis may split it into other parts).
        let whole = |t: &Tensor| {
            t.to_global(placement, NdSbp::broadcast(l.shape.len()))
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec::<f64>()
                .unwrap()
        };
        let alone: Vec<Vec<f64>> = shards
            .iter()
            .map(|s| {
                let nd = s.nd_sbp().unwrap().with_axis(l.axis, Sbp::B);
                whole(&s.to_global(placement, nd).unwrap())
            })
            .collect();
        match gather_bucket(&shards, l.axis) {
            Ok(out) => {
                assert!(fits, "a bucket that does not fit was gathered");
                assert_bucket_layouts(&out, &shards, l.axis, Sbp::B);
                let pieces = out.iter().map(whole).collect();
                Ok((pieces, alone))
            }
            Err(e) => {
                assert!(!fits, "a bucket that fits failed: {e}");
                Err(e.to_string())
            }
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn a_bucket_equals_gathering_each_tensor(case in case()) {
        let got = run(&case);
        if got.iter().any(|r| r.is_err()) {
            // Every rank agrees, and only a nested dim-0 split is no row range.
            prop_assert!(got.iter().all(|r| r.is_err()), "{:?}", got);
            prop_assert!(case.layout.tensors.iter().any(|t| t.2 == Sbp::S(0)), "{:?}", got);
            for e in got.iter().filter_map(|r| r.as_ref().err()) {
                prop_assert!(e.contains("not row ranges"), "{}", e);
            }
        }
        // The values move as they are: bit for bit, unless a P axis sums parts (whose order
        // may differ between the two boxings when it has more than two members).
        let summed = case.layout.tensors.iter().any(|t| t.2 == Sbp::Partial(ReduceOp::Sum));
        let tol = if case.dtype == DType::BF16 { 1e-2 } else { 1e-12 };
        for (bucket, alone) in got.into_iter().flatten() {
            if !summed {
                prop_assert_eq!(bucket, alone);
                continue;
            }
            bucket_close(&bucket, &alone, tol)?;
        }
    }
}

#[test]
fn a_bucket_the_gather_cannot_take_is_refused_before_communication() {
    let errs = refused_buckets(Sbp::S(0), (&[2, 3], Sbp::S(1)), |t| gather_bucket(t, 0));
    for (dtype, split) in errs {
        assert!(
            dtype.contains("gather_bucket") && dtype.contains("dtype"),
            "{dtype}"
        );
        assert!(
            split.contains("not split along dim 0 on mesh axis 0"),
            "{split}"
        );
    }
}

/// A rank outside the tensors' placement (a pipeline stage's parameters seen from another
/// stage) gets them laid out gathered, with no piece and no communication; the members get the
/// values.
#[test]
fn a_rank_outside_the_placement_gets_the_layouts_only() {
    let placement = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
    let out = run_ranks(3, TIMEOUT, |_| {
        let whole = Tensor::arange(0.0, 10.0, 1.0, DType::F64)
            .unwrap()
            .add_scalar(1.0)
            .unwrap()
            .reshape([5, 2])
            .unwrap();
        let shard = whole
            .to_global(&placement, Sbp::B)
            .unwrap()
            .to_global(&placement, Sbp::S(0))
            .unwrap();
        let got = gather_bucket(&[shard.clone(), shard], 0).unwrap();
        got.iter()
            .map(|t| {
                (
                    t.nd_sbp().cloned(),
                    t.shape().clone(),
                    t.to_local().to_vec::<f64>().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    });
    let want: Vec<f64> = (1..=10).map(f64::from).collect();
    for (rank, got) in out.iter().enumerate() {
        for (nd, shape, local) in got {
            assert_eq!(nd.as_ref(), Some(&NdSbp::new([Sbp::B])), "rank {rank}");
            assert_eq!(shape.dims(), &[5, 2]);
            match rank {
                2 => assert!(local.is_empty(), "rank 2 holds {local:?}"),
                _ => assert_eq!(local, &want, "rank {rank}"),
            }
        }
    }
}
