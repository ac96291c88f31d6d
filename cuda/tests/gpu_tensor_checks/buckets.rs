//! Gradient buckets on the device: `reduce_bucket` over a 1-d placement (all-reduce and
//! reduce-scatter targets, the gradients' own dtype and a bf16 wire) against each tensor boxed
//! alone, with the pieces cut from the reduced buffer (views of its memory on CUDA) read, used
//! by ops, outliving the buffer's other pieces and the next bucket's allocations; and
//! `gather_bucket` (f32, bf16) against each shard gathered alone, bit for bit, its pieces
//! likewise read after the others were dropped.

use oxiflow_tensor::{gather_bucket, reduce_bucket, BucketTarget};

use super::*;

/// Uneven shapes: a scalar-like row, an odd matrix, a tall one, one with fewer rows than ranks.
const SHAPES: [&[usize]; 5] = [&[1], &[7, 3], &[129, 65], &[1000, 33], &[1, 5]];

/// Every rank's random never-zero part of each gradient, P(sum) on `pl`.
fn partials(pl: &Placement, rank: usize, dtype: DType, round: u64) -> Result<Vec<Tensor>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let seed = 1_000 * round + 10 * i as u64 + rank as u64;
            let part = Tensor::randn(Shape::from(*s), seed, DType::F32)
                .abs()?
                .add_scalar(0.125)?
                .mul_scalar(if i % 2 == 0 { 1.0 } else { -2.0 })?
                .cast(dtype)?;
            part.to_global(pl, Sbp::P)
        })
        .collect()
}

/// Each case's bucket against the tensors boxed alone; returns how many tensors were checked.
pub(crate) fn child_buckets(world: usize, rank: usize, device: DeviceType) -> Checked {
    let pl =
        Placement::new_1d(device, (0..world).collect::<Vec<_>>()).map_err(|e| e.to_string())?;
    let cases = [
        (BucketTarget::Broadcast, DType::F32, None),
        (BucketTarget::Shard, DType::F32, None),
        (BucketTarget::Broadcast, DType::F64, None),
        (BucketTarget::Broadcast, DType::F32, Some(DType::BF16)),
        (BucketTarget::Shard, DType::F32, Some(DType::BF16)),
    ];
    let mut checked = 0;
    for (round, (target, dtype, wire)) in cases.into_iter().enumerate() {
        let what = format!("bucket {target:?} {dtype} wire {wire:?}");
        let e = |step: &str, err: oxiflow_tensor::TensorError| format!("{what}: {step}: {err}");
        let grads = partials(&pl, rank, dtype, round as u64).map_err(|x| e("inputs", x))?;
        let sbp = match target {
            BucketTarget::Broadcast => Sbp::B,
            BucketTarget::Shard => Sbp::S(0),
        };
        // Alone: each part moved as the wire dtype, boxed, back in f64.
        let alone: Vec<Vec<f64>> = grads
            .iter()
            .map(|g| {
                let moved = match wire {
                    Some(w) => g.to_dtype(w)?,
                    None => g.clone(),
                };
                values(&moved.to_global(&pl, sbp)?)
            })
            .collect::<Result<_>>()
            .map_err(|x| e("alone", x))?;
        let mut out = reduce_bucket(&grads, 0, target, wire).map_err(|x| e("reduce", x))?;
        drop(grads);
        let tol = if wire.is_some() { 1e-2 } else { 1e-6 };
        let check = |i: usize, got: &[f64], want: &[f64], how: &str| {
            close_to(got, want, tol).map_err(|d| format!("{what}: tensor {i} {how}: {d}"))
        };
        // Drop every other piece first, then allocate: the kept pieces keep their memory.
        for i in (0..out.len()).rev().filter(|i| i % 2 == 1) {
            out.remove(i);
        }
        let _noise: Vec<Tensor> = SHAPES
            .iter()
            .map(|s| Tensor::randn_global(Shape::from(*s), 99, dtype, &pl, Sbp::B))
            .collect::<Result<_>>()
            .map_err(|x| e("noise", x))?;
        for (k, o) in out.iter().enumerate() {
            let i = 2 * k;
            if o.dtype() != dtype || o.nd_sbp() != Some(&NdSbp::new([sbp])) {
                return Err(format!("{what}: tensor {i} came back as {}", o.describe()));
            }
            check(i, &values(o).map_err(|x| e("read", x))?, &alone[i], "read")?;
            let twice: Vec<f64> = alone[i].iter().map(|v| 2.0 * v).collect();
            let doubled = o
                .mul_scalar(2.0)
                .and_then(|t| values(&t))
                .map_err(|x| e("op", x))?;
            check(i, &doubled, &twice, "doubled")?;
            checked += 1;
        }
    }
    for (round, dtype) in [DType::F32, DType::BF16].into_iter().enumerate() {
        let what = format!("gather {dtype}");
        let e = |step: &str, err: oxiflow_tensor::TensorError| format!("{what}: {step}: {err}");
        // Every rank's shards of one broadcast value (uneven, and empty where rows run out).
        let shards: Vec<Tensor> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let seed = 7_000 + 100 * round as u64 + i as u64;
                Tensor::randn_global(Shape::from(*s), seed, DType::F32, &pl, Sbp::B)?
                    .abs()?
                    .add_scalar(0.125)?
                    .cast(dtype)?
                    .to_global(&pl, Sbp::S(0))
            })
            .collect::<Result<_>>()
            .map_err(|x| e("inputs", x))?;
        let alone: Vec<Vec<f64>> = shards
            .iter()
            .map(|s| values(&s.to_global(&pl, Sbp::B)?))
            .collect::<Result<_>>()
            .map_err(|x| e("alone", x))?;
        let mut out = gather_bucket(&shards, 0).map_err(|x| e("gather", x))?;
        drop(shards);
        for i in (0..out.len()).rev().filter(|i| i % 2 == 0) {
            out.remove(i);
        }
        for (k, o) in out.iter().enumerate() {
            let i = 2 * k + 1;
            if o.dtype() != dtype || o.nd_sbp() != Some(&NdSbp::new([Sbp::B])) {
                return Err(format!("{what}: tensor {i} came back as {}", o.describe()));
            }
            let got = values(o).map_err(|x| e("read", x))?;
            if got != alone[i] {
                return Err(format!("{what}: tensor {i} differs from its gather alone"));
            }
            checked += 1;
        }
    }
    Ok(checked)
}
