//! `reduce_bucket`: several partial sums reduced over one mesh axis by one collective give
//! the layouts and values that boxing each tensor alone gives (all-reduce to B and
//! reduce-scatter to S(0); 1-d and 2-d meshes, either axis, uneven and empty shards, the other
//! axis B, S(0), S(1) or P; equal up to the order of a sum's terms), also when the buffer moves
//! as another dtype (f32 or bf16 for f64 gradients: each rank's part rounded once, then
//! summed); a shard that is not a row range of the piece is a typed error on
//! every rank of the group before any communication.

mod common;

use std::time::Duration;

use common::{assert_bucket_layouts, bucket_close, bucket_layout, refused_buckets, BucketLayout};
use oxiflow_placement::DeviceType;
use oxiflow_tensor::{
    bucket_fits, reduce_bucket, run_ranks, BucketTarget, DType, NdSbp, Placement, ReduceOp, Sbp,
    Tensor,
};
use proptest::prelude::*;

const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
struct Case {
    layout: BucketLayout,
    target: BucketTarget,
    /// The dtype the buffer moves as (None: the gradients' own).
    wire: Option<DType>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        bucket_layout(0..7, 1..5),
        prop_oneof![Just(BucketTarget::Broadcast), Just(BucketTarget::Shard)],
        prop_oneof![Just(None), Just(Some(DType::F32)), Just(Some(DType::BF16))],
    )
        .prop_map(|(layout, target, wire)| Case {
            layout,
            target,
            wire,
        })
}

/// Runs `case` on in-process ranks: (per rank) the values of the bucket's tensors and of each
/// tensor boxed alone (their pieces may differ where another axis is P), or the bucket's error
/// text.
#[allow(clippy::type_complexity)]
fn run(case: &Case) -> Vec<Result<(Vec<Vec<f64>>, Vec<Vec<f64>>), String>> {
    let l = &case.layout;
    l.on_ranks(|placement, rank| {
        // Each gradient, and it as the ranks' parts converted to the wire dtype.
        let on_axis = Sbp::Partial(ReduceOp::Sum);
        let (grads, moved): (Vec<Tensor>, Vec<Tensor>) = l
            .pieces(placement, rank, on_axis, |nd, local, seed| {
                let part = Tensor::randn(local, seed, DType::F64);
                let wired = match case.wire {
                    Some(w) => part.to_dtype(w).unwrap(),
                    None => part.clone(),
                };
                (
                    part.to_global_checked(placement, nd.clone()).unwrap(),
                    wired.to_global_checked(placement, nd).unwrap(),
                )
            })
            .into_iter()
            .unzip();
        let fits = grads.iter().all(|g| bucket_fits(g, l.axis, case.target));
        let sbp = match case.target {
            BucketTarget::Broadcast => Sbp::B,
            BucketTarget::Shard => Sbp::S(0),
        };
        let alone: Vec<Vec<f64>> = moved
            .iter()
            .map(|g| {
                let nd = g.nd_sbp().unwrap().with_axis(l.axis, sbp);
                g.to_global(placement, nd)
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec::<f64>()
                    .unwrap()
            })
            .collect();
        match reduce_bucket(&grads, l.axis, case.target, case.wire) {
            Ok(out) => {
                assert!(fits, "a bucket that does not fit was reduced");
                assert_bucket_layouts(&out, &grads, l.axis, sbp);
                let pieces = out.iter().map(|o| o.to_vec::<f64>().unwrap()).collect();
                Ok((pieces, alone))
            }
            Err(e) => Err(e.to_string()),
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn a_bucket_equals_boxing_each_tensor(case in case()) {
        let got = run(&case);
        let fails = got.iter().filter(|r| r.is_err()).count();
        if fails > 0 {
            // Every rank of a group agrees; the shard layout must really be no row range.
            prop_assert_eq!(case.target, BucketTarget::Shard);
            prop_assert!(case.layout.tensors.iter().any(|t| t.2 == Sbp::S(0)), "{:?}", got);
            for r in &got {
                if let Err(e) = r {
                    prop_assert!(e.contains("not row ranges"), "{}", e);
                }
            }
        }
        // The same sums; the in-process backend may add a chunk's members in another order
        // when the chunk boundaries move, so the last bit (of the wire dtype) may differ.
        let tol = match case.wire {
            None => 1e-12,
            Some(DType::F32) => 1e-6,
            Some(_) => 2e-2,
        };
        for (bucket, alone) in got.into_iter().flatten() {
            bucket_close(&bucket, &alone, tol)?;
        }
    }
}

#[test]
fn a_bucket_of_mixed_dtypes_is_refused_before_communication() {
    let partial = Sbp::Partial(ReduceOp::Sum);
    let errs = refused_buckets(partial, (&[3], Sbp::B), |t| {
        reduce_bucket(t, 0, BucketTarget::Broadcast, None)
    });
    for (dtype, sbp) in errs {
        assert!(
            dtype.contains("reduce_bucket") && dtype.contains("dtype"),
            "{dtype}"
        );
        assert!(sbp.contains("not a partial sum on mesh axis 0"), "{sbp}");
    }
}

/// `to_dtype_parts` keeps a partial sum partial, each rank's part rounded once (so it can join
/// a bucket), where `to_dtype` of a partial sum that may round reduces it first; both convert
/// the value, differently rounded, and a widening `to_dtype` keeps the partial sum exactly.
#[test]
fn a_cast_of_parts_keeps_the_partial_sum() {
    let placement = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
    let out = run_ranks(2, TIMEOUT, |rank| {
        let p = NdSbp::new([Sbp::Partial(ReduceOp::Sum)]);
        // Parts whose bf16 roundings differ from the rounded sum's.
        let part = match rank {
            0 => vec![1.005f32, 1.004],
            _ => vec![1.003f32, 0.504],
        };
        let g = Tensor::from_vec(part.clone(), [2])
            .unwrap()
            .to_global(&placement, p.clone())
            .unwrap();
        let parts = g.to_dtype_parts(DType::BF16).unwrap();
        let whole = g.to_dtype(DType::BF16).unwrap();
        let widened = parts.to_dtype(DType::F32).unwrap();
        (
            parts.nd_sbp().cloned(),
            whole.nd_sbp().cloned(),
            widened.nd_sbp().cloned(),
            parts.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(),
            whole.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(),
            part,
        )
    });
    let round = |x: f32| f64::from(oxiflow_tensor::bf16::from_f32(x).to_f32());
    for (parts_sbp, whole_sbp, widened_sbp, parts, whole, _) in &out {
        let p = NdSbp::new([Sbp::Partial(ReduceOp::Sum)]);
        assert_eq!(parts_sbp.as_ref(), Some(&p));
        assert_eq!(widened_sbp.as_ref(), Some(&p), "a widening cast keeps P");
        assert_ne!(
            whole_sbp.as_ref(),
            Some(&p),
            "a rounding cast reduces first"
        );
        for i in 0..2 {
            let (a, b) = (out[0].5[i], out[1].5[i]);
            assert_eq!(
                parts[i],
                round(a) + round(b),
                "the sum of the rounded parts"
            );
            assert_eq!(whole[i], round(a + b), "the rounded sum");
        }
        assert_ne!(parts, whole, "the data tells the two apart");
    }
}
