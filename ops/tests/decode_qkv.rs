//! `rotary_qkv_at` through the public op contract: the split and rotation of a fused
//! query/key/value projection `[B, T, G, R + 2, D]` equals `rotary_at` on its query heads and
//! key and a copy of its value, bit for bit, in every float dtype; the typed errors; and the
//! global property: the batch or the groups split (uneven batches, empty pieces), broadcast or
//! partial, on 1-d and 2-d meshes, give one rank's values.

mod common;

use std::time::Duration;

use common::{close, nd_sbp_of, never_zero, position, rotary_frequencies, vals};

use oxiflow_ops::decode::{rotary_at, rotary_qkv_at};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Placement, Sbp, Tensor, TensorError};
use proptest::prelude::*;

/// Sizes of one case: batch, positions, groups, query heads a group, head width, position.
#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    t: usize,
    g: usize,
    r: usize,
    d: usize,
    pos: usize,
}

fn dims() -> impl Strategy<Value = Dims> {
    (
        1usize..4,
        1usize..3,
        1usize..4,
        1usize..4,
        1usize..4,
        0usize..40,
    )
        .prop_map(|(b, t, g, r, half, pos)| Dims {
            b,
            t,
            g,
            r,
            d: 2 * half,
            pos,
        })
}

/// The frequencies of rotary's usual base for heads of `d`.
fn frequencies(d: usize) -> Tensor {
    rotary_frequencies(d, 10_000.0)
}

fn qkv(d: Dims, seed: u64) -> Tensor {
    let shape = [d.b, d.t, d.g, d.r + 2, d.d];
    Tensor::from_vec(never_zero(shape.iter().product(), seed), shape).unwrap()
}

/// The split and rotation composed of `rotary_at` and narrowing.
fn composed(x: &Tensor, f: &Tensor, pos: &Tensor, d: Dims) -> [Vec<f64>; 3] {
    let heads = |from: usize, n: usize, h: usize| {
        x.narrow(3, from, n)
            .unwrap()
            .reshape([d.b, d.t, h, d.d])
            .unwrap()
    };
    let q = rotary_at(&heads(0, d.r, d.g * d.r), f, pos).unwrap();
    let k = rotary_at(&heads(d.r, 1, d.g), f, pos).unwrap();
    [vals(&q), vals(&k), vals(&heads(d.r + 1, 1, d.g))]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn split_and_rotation_equal_rotary_at_on_the_pieces(
        d in dims(),
        seed in any::<u64>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16, DType::F16]),
    ) {
        let x = qkv(d, seed).cast(dt).unwrap();
        let (f, pos) = (frequencies(d.d), position(d.pos));
        let (q, k, v) = rotary_qkv_at(&x, &f, &pos).unwrap();
        prop_assert_eq!(q.shape().dims(), &[d.b, d.t, d.g * d.r, d.d][..]);
        prop_assert_eq!(k.shape().dims(), &[d.b, d.t, d.g, d.d][..]);
        prop_assert_eq!(v.shape().dims(), &[d.b, d.t, d.g, d.d][..]);
        prop_assert!([&q, &k, &v].iter().all(|t| t.dtype() == dt));
        let want = composed(&x, &f, &pos, d);
        for (got, (want, what)) in [q, k, v].iter().zip(want.iter().zip(["q", "k", "v"])) {
            close(&vals(got), want, 0.0, &format!("{what} {dt} {d:?}"));
        }
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let (f, pos) = (frequencies(4), position(3));
    let x = Tensor::zeros([1, 1, 2, 3, 4], DType::F32);
    let cases: Vec<(Tensor, Tensor, Tensor, &str)> = vec![
        (
            Tensor::zeros([1, 1, 6, 4], DType::F32),
            f.clone(),
            pos.clone(),
            "[B, T, G, R + 2, D]",
        ),
        (
            Tensor::zeros([1, 1, 2, 2, 4], DType::F32),
            f.clone(),
            pos.clone(),
            "no query head",
        ),
        (
            Tensor::zeros([1, 1, 2, 3, 5], DType::F32),
            frequencies(4),
            pos.clone(),
            "even",
        ),
        (
            x.clone(),
            frequencies(4).cast(DType::F32).unwrap(),
            pos.clone(),
            "frequencies",
        ),
        (x.clone(), frequencies(6), pos.clone(), "frequencies"),
        (
            x.clone(),
            f.clone(),
            Tensor::zeros([2], DType::I64),
            "position",
        ),
        (
            Tensor::zeros([1, 1, 2, 3, 4], DType::I64),
            f.clone(),
            pos.clone(),
            "float",
        ),
    ];
    for (x, f, p, says) in cases {
        let e = rotary_qkv_at(&x, &f, &p).unwrap_err();
        assert!(
            matches!(e, TensorError::Shape { .. } | TensorError::DType { .. }),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("rotary_qkv_at") && text.contains(says),
            "{text}"
        );
    }
}

/// One SBP per mesh axis for qkv: the batch (dim 0) or the groups (dim 2) split, broadcast or
/// partial.
fn layout(naxes: usize, seed: u64) -> NdSbp {
    nd_sbp_of(naxes, seed, &[Sbp::S(0), Sbp::S(2), Sbp::B, Sbp::P])
}

fn global_case(p: &Placement, extra: bool, d: Dims, seed: u64, lseed: u64) {
    let world = p.num_ranks() + usize::from(extra);
    let nd = layout(p.ndim(), lseed);
    let x = qkv(d, seed);
    let (f, pos) = (frequencies(d.d), position(d.pos));
    let (q, k, v) = rotary_qkv_at(&x, &f, &pos).unwrap();
    let want = [vals(&q), vals(&k), vals(&v)];
    let results = run_ranks(world, Duration::from_secs(30), |rank| {
        let b = NdSbp::broadcast(p.ndim());
        let x = x
            .to_global(p, b.clone())
            .unwrap()
            .to_global(p, nd.clone())
            .unwrap();
        let f = f.to_global(p, b.clone()).unwrap();
        let pos = pos.to_global(p, b).unwrap();
        let (q, k, v) = rotary_qkv_at(&x, &f, &pos).unwrap();
        p.contains(rank).then(|| [vals(&q), vals(&k), vals(&v)])
    });
    for (rank, got) in results.into_iter().enumerate() {
        let Some(got) = got else { continue };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            close(
                g,
                w,
                1e-12,
                &format!("output {i}, rank {rank} on {p}, qkv {nd}, {d:?}"),
            );
        }
    }
}

common::decode_layouts_equal_one_rank!();
