//! The decoding ops through the public op contract: `decode_attention` against an f64
//! softmax-attention over the cached keys and the new one (grouped-query heads, every
//! position up to the cache's end), `rotary_at` against the fused rotary op at the same first
//! position, `write_rows` against the rows placed by hand (and `write_rows_in_place` on the
//! host making new caches); each in every float dtype; the typed errors; and the global
//! property: batch or heads split (uneven batches, empty pieces) or broadcast on 1-d and 2-d
//! meshes give one rank's values. `decode_attention_blocks` (the cache cut into blocks, each
//! attended to apart and merged) against the same reference, whole and with the caches split
//! on their positions over a mesh axis (a context-parallel cache) beside a batch split or
//! broadcast on another, with `write_rows` into caches split on the written dim.

mod common;

use std::time::Duration;

use common::{
    assert_op_error, close, meshes, nd_sbp_of, never_zero, placement, position, rotary_frequencies,
    vals,
};

use oxiflow_ops::decode::{
    decode_attention, decode_attention_blocks, decode_attention_parts, rotary_at, write_rows,
    write_rows_in_place,
};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Placement, Sbp, Tensor};
use proptest::prelude::*;

/// Sizes of one decoding attention case.
#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    h: usize,
    g: usize,
    d: usize,
    p: usize,
    pos: usize,
}

/// q, the key and value caches, the new key and value (f64 values) of `d`.
fn operands(d: Dims, seed: u64) -> [Vec<f64>; 5] {
    let q = d.b * d.h * d.d;
    let c = d.b * d.p * d.g * d.d;
    let n = d.b * d.g * d.d;
    [
        never_zero(q, seed),
        never_zero(c, seed.wrapping_add(1)),
        never_zero(c, seed.wrapping_add(2)),
        never_zero(n, seed.wrapping_add(3)),
        never_zero(n, seed.wrapping_add(4)),
    ]
}

/// The f64 attention of each query head over keys 0..pos of the cache and the new key.
fn reference(d: Dims, [q, kc, vc, k, v]: &[Vec<f64>; 5], scale: f64) -> Vec<f64> {
    let mut out = vec![0.0; q.len()];
    for b in 0..d.b {
        for h in 0..d.h {
            let g = h / (d.h / d.g);
            let row = |c: &[f64], n: &[f64], j: usize| -> Vec<f64> {
                let at = if j < d.pos {
                    ((b * d.p + j) * d.g + g) * d.d
                } else {
                    (b * d.g + g) * d.d
                };
                (if j < d.pos { c } else { n })[at..at + d.d].to_vec()
            };
            let qr = &q[(b * d.h + h) * d.d..(b * d.h + h + 1) * d.d];
            let s: Vec<f64> = (0..=d.pos)
                .map(|j| {
                    qr.iter()
                        .zip(row(kc, k, j))
                        .map(|(a, b)| a * b)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let total: f64 = w.iter().sum();
            for (j, wj) in w.iter().enumerate() {
                for (e, x) in row(vc, v, j).iter().enumerate() {
                    out[(b * d.h + h) * d.d + e] += wj / total * x;
                }
            }
        }
    }
    out
}

fn tensors(d: Dims, ops: &[Vec<f64>; 5], dt: DType) -> [Tensor; 5] {
    let shapes = [
        vec![d.b, 1, d.h, d.d],
        vec![d.b, d.p, d.g, d.d],
        vec![d.b, d.p, d.g, d.d],
        vec![d.b, 1, d.g, d.d],
        vec![d.b, 1, d.g, d.d],
    ];
    [0, 1, 2, 3, 4].map(|i| {
        Tensor::from_vec(ops[i].clone(), shapes[i].clone())
            .unwrap()
            .cast(dt)
            .unwrap()
    })
}

fn dims() -> impl Strategy<Value = Dims> {
    (
        1usize..4,
        prop::sample::select(vec![(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (6, 3)]),
        prop::sample::select(vec![1usize, 2, 6, 8]),
        1usize..7,
    )
        .prop_flat_map(|(b, (h, g), d, p)| (0..=p).prop_map(move |pos| Dims { b, h, g, d, p, pos }))
}

/// Tolerance of a dtype's result against the f64 reference.
fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        _ => 2e-2,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn attention_matches_the_f64_reference(
        d in dims(),
        seed in any::<u64>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16, DType::F16]),
    ) {
        let ops = operands(d, seed);
        let scale = 1.0 / (d.d as f64).sqrt();
        let want = reference(d, &ops, scale);
        let [q, kc, vc, k, v] = tensors(d, &ops, dt);
        let got = decode_attention(&q, (&kc, &vc), (&k, &v), &position(d.pos), scale).unwrap();
        prop_assert_eq!(got.dtype(), dt);
        prop_assert_eq!(got.shape().dims(), &[d.b, 1, d.h, d.d][..]);
        // 16-bit inputs are rounded before the kernel sees them: compare with their values.
        let rounded: [Vec<f64>; 5] = [&q, &kc, &vc, &k, &v].map(vals);
        close(&vals(&got), &reference(d, &rounded, scale), tolerance(dt), "decode_attention");
        if dt == DType::F64 {
            close(&vals(&got), &want, 1e-12, "decode_attention f64");
        }
    }

    #[test]
    fn rotary_matches_the_fused_rotary_op(
        b in 1usize..3,
        t in 1usize..4,
        h in 1usize..4,
        half in 1usize..5,
        pos in 0usize..50,
        seed in any::<u64>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16, DType::F16]),
    ) {
        let d = 2 * half;
        let theta = 10_000.0f64;
        let x = Tensor::from_vec(never_zero(b * t * h * d, seed), [b, t, h, d]).unwrap().cast(dt).unwrap();
        let f = rotary_frequencies(d, theta);
        let got = rotary_at(&x, &f, &position(pos)).unwrap();
        let want = x.rotary_from(1, theta, pos).unwrap();
        prop_assert_eq!(got.dtype(), dt);
        close(&vals(&got), &vals(&want), if dt == DType::F64 { 1e-12 } else { 1e-6 }, "rotary_at");
    }

    #[test]
    fn rows_land_at_their_positions(
        b in 1usize..3,
        p in 1usize..6,
        inner in 1usize..4,
        at_t in (0usize..6, 0usize..3),
        seed in any::<u64>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64]),
    ) {
        let (at, t) = (at_t.0.min(p), at_t.1.min(p - at_t.0.min(p)));
        let cache = never_zero(b * p * inner, seed).iter().map(|v| (v * 8.0).round()).collect::<Vec<_>>();
        let rows = never_zero(b * t * inner, seed.wrapping_add(1)).iter().map(|v| (v * 8.0).round()).collect::<Vec<_>>();
        let mut want = cache.clone();
        for bi in 0..b {
            for j in 0..t {
                for e in 0..inner {
                    want[(bi * p + at + j) * inner + e] = rows[(bi * t + j) * inner + e];
                }
            }
        }
        let c = Tensor::from_vec(cache, [b, p, inner]).unwrap().cast(dt).unwrap();
        let r = Tensor::from_vec(rows, [b, t, inner]).unwrap().cast(dt).unwrap();
        let got = write_rows(&[&c], &[&r], 1, at).unwrap();
        prop_assert_eq!(vals(&got[0]), want.clone());
        let mut caches = vec![c.clone(), c];
        write_rows_in_place(&mut caches, &[&r, &r], 1, at).unwrap();
        prop_assert_eq!(vals(&caches[0]), want.clone());
        prop_assert_eq!(vals(&caches[1]), want);
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let d = Dims {
        b: 1,
        h: 4,
        g: 2,
        d: 4,
        p: 3,
        pos: 3,
    };
    let [q, kc, vc, k, v] = tensors(d, &operands(d, 5), DType::F32);
    // A position past the cache's end.
    let e = decode_attention(&q, (&kc, &vc), (&k, &v), &position(4), 0.5).unwrap_err();
    assert_op_error!(e, Kernel, "decode_attention");
    // Key/value heads that do not divide the query heads.
    let d3 = Dims { g: 3, ..d };
    let [_, kc3, vc3, k3, v3] = tensors(d3, &operands(d3, 5), DType::F32);
    let e = decode_attention(&q, (&kc3, &vc3), (&k3, &v3), &position(1), 0.5).unwrap_err();
    assert_op_error!(e, Shape, "decode_attention");
    // Mixed dtypes; a position that is not one i64.
    let e = decode_attention(
        &q,
        (&kc.cast(DType::F64).unwrap(), &vc),
        (&k, &v),
        &position(1),
        0.5,
    )
    .unwrap_err();
    assert_op_error!(e, DType, "decode_attention");
    let two = Tensor::from_vec(vec![1i64, 2], [2]).unwrap();
    let e = decode_attention(&q, (&kc, &vc), (&k, &v), &two, 0.5).unwrap_err();
    assert_op_error!(e, Shape, "decode_attention");
    // Frequencies of the wrong length; rows that overrun the cache.
    let f = Tensor::from_vec(vec![1.0f64; 3], [3]).unwrap();
    let e = rotary_at(&q, &f, &position(0)).unwrap_err();
    assert_op_error!(e, Shape, "rotary_at");
    let e = write_rows(&[&kc], &[&k], 1, 3).unwrap_err();
    assert_op_error!(e, Shape, "write_rows");
    let e = write_rows(&[&kc], &[], 1, 0).unwrap_err();
    assert_op_error!(e, Shape, "write_rows");
}

/// One SBP per mesh axis for the decoding operands: the batch (dim 0) or the heads (dim 2)
/// split, or broadcast.
fn layout(naxes: usize, seed: u64) -> NdSbp {
    nd_sbp_of(naxes, seed, &[Sbp::S(0), Sbp::S(2), Sbp::B])
}

fn global_case(p: &Placement, extra: bool, d: Dims, seed: u64, lseed: u64) {
    let world = p.num_ranks() + usize::from(extra);
    let nd = layout(p.ndim(), lseed);
    let ops = operands(d, seed);
    let scale = 0.7;
    let want = reference(d, &ops, scale);
    let results = run_ranks(world, Duration::from_secs(30), |rank| {
        let b = NdSbp::broadcast(p.ndim());
        let lay = |t: &Tensor| {
            t.to_global(p, b.clone())
                .unwrap()
                .to_global(p, nd.clone())
                .unwrap()
        };
        let [q, kc, vc, k, v] = tensors(d, &ops, DType::F64).map(|t| lay(&t));
        let pos = position(d.pos).to_global(p, b.clone()).unwrap();
        let o = decode_attention(&q, (&kc, &vc), (&k, &v), &pos, scale).unwrap();
        // The new key written at pos, in place where it may, into new caches here (host).
        let mut caches = vec![kc];
        let at = d.pos.min(d.p - 1);
        write_rows_in_place(&mut caches, &[&k], 1, at).unwrap();
        let xr = lay(&Tensor::from_vec(
            never_zero(d.b * 2 * d.h * d.d, seed.wrapping_add(9)),
            [d.b, 2, d.h, d.d],
        )
        .unwrap());
        let f = Tensor::from_vec(vec![0.5, 0.25, 0.125], [3])
            .unwrap()
            .to_global(p, b.clone())
            .unwrap();
        let rot = (d.d == 6).then(|| rotary_at(&xr, &f, &pos).unwrap());
        p.contains(rank)
            .then(|| (vals(&o), vals(&caches[0]), rot.map(|r| vals(&r))))
    });
    let [_, kc, _, k, _] = tensors(d, &ops, DType::F64);
    let at = d.pos.min(d.p - 1);
    let cache_want = vals(&write_rows(&[&kc], &[&k], 1, at).unwrap()[0]);
    let xr = Tensor::from_vec(
        never_zero(d.b * 2 * d.h * d.d, seed.wrapping_add(9)),
        [d.b, 2, d.h, d.d],
    )
    .unwrap();
    let f = Tensor::from_vec(vec![0.5, 0.25, 0.125], [3]).unwrap();
    let rot_want = (d.d == 6).then(|| vals(&rotary_at(&xr, &f, &position(d.pos)).unwrap()));
    for (rank, got) in results.into_iter().enumerate() {
        let Some((o, cache, rot)) = got else { continue };
        let what = format!("rank {rank} on {p}, operands {nd}, {d:?}");
        close(&o, &want, 1e-12, &format!("attention, {what}"));
        close(&cache, &cache_want, 0.0, &format!("cache, {what}"));
        if let (Some(r), Some(w)) = (rot, &rot_want) {
            close(&r, w, 1e-12, &format!("rotary, {what}"));
        }
    }
}

common::decode_layouts_equal_one_rank!();

/// Cases of the blocks' attention: `blocks` blocks of 1 to 3 positions, every position.
fn blocks_dims() -> impl Strategy<Value = (Dims, usize)> {
    (
        1usize..3,
        prop::sample::select(vec![(1, 1), (2, 1), (4, 2), (6, 3)]),
        prop::sample::select(vec![1usize, 2, 8]),
        1usize..5,
        1usize..4,
    )
        .prop_flat_map(|(b, (h, g), d, blocks, per)| {
            let p = blocks * per;
            (0..=p).prop_map(move |pos| (Dims { b, h, g, d, p, pos }, blocks))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn blocks_merge_to_the_f64_reference(
        (d, blocks) in blocks_dims(),
        seed in any::<u64>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16, DType::F16]),
    ) {
        let ops = operands(d, seed);
        let scale = 1.0 / (d.d as f64).sqrt();
        let [q, kc, vc, k, v] = tensors(d, &ops, dt);
        let got = decode_attention_blocks(&q, (&kc, &vc), (&k, &v), &position(d.pos), scale, blocks).unwrap();
        prop_assert_eq!(got.dtype(), dt);
        prop_assert_eq!(got.shape().dims(), &[d.b, 1, d.h, d.d][..]);
        let rounded: [Vec<f64>; 5] = [&q, &kc, &vc, &k, &v].map(vals);
        close(&vals(&got), &reference(d, &rounded, scale), tolerance(dt), "decode_attention_blocks");
        // A block without keys (wholly at or after the position, not holding it) is zeros and
        // -inf; the others' log-sum-exp is finite.
        let (o, lse) = decode_attention_parts(&q, (&kc, &vc), (&k, &v), &position(d.pos), scale, blocks).unwrap();
        prop_assert_eq!(o.dtype(), dt.compute());
        let per = d.p / blocks;
        let owner = (d.pos / per).min(blocks - 1);
        let (o, lse) = (vals(&o), vals(&lse));
        for (i, l) in lse.iter().enumerate() {
            let c = i / d.h % blocks;
            let empty = c * per >= d.pos && c != owner;
            prop_assert_eq!(l.is_infinite() && *l < 0.0, empty, "block {} of {:?}", c, d);
            if empty {
                let row = &o[i * d.d..(i + 1) * d.d];
                prop_assert!(row.iter().all(|&x| x == 0.0));
            }
        }
    }
}

/// The blocks' attention with the caches split on their positions over mesh axis `seq` (q,
/// the new key and value whole there) and the batch split or all whole on the others, and rows
/// written into caches so split, against one rank's values.
fn split_cache_case(p: &Placement, seq: usize, d: Dims, blocks: usize, seed: u64, lseed: u64) {
    let others = nd_sbp_of(p.ndim(), lseed, &[Sbp::S(0), Sbp::B]);
    let with = |s: Sbp| {
        NdSbp::new(
            others
                .iter()
                .enumerate()
                .map(|(a, o)| if a == seq { s } else { o })
                .collect::<Vec<_>>(),
        )
    };
    let (whole, split) = (with(Sbp::B), with(Sbp::S(1)));
    let ops = operands(d, seed);
    let scale = 0.6;
    let want = reference(d, &ops, scale);
    // Two rows written from just before the last block's start (across a boundary).
    let rows_at = d.p.saturating_sub(d.p / blocks + 1).min(d.p - 2.min(d.p));
    let t = 2.min(d.p);
    let rows = never_zero(d.b * t * d.g * d.d, seed.wrapping_add(7));
    let results = run_ranks(p.num_ranks(), Duration::from_secs(30), |_| {
        let b = NdSbp::broadcast(p.ndim());
        let lay = |t: &Tensor, nd: &NdSbp| {
            t.to_global(p, b.clone())
                .unwrap()
                .to_global(p, nd.clone())
                .unwrap()
        };
        let [q, kc, vc, k, v] = tensors(d, &ops, DType::F64);
        let (q, k, v) = (lay(&q, &whole), lay(&k, &whole), lay(&v, &whole));
        let (kc, vc) = (lay(&kc, &split), lay(&vc, &split));
        let pos = position(d.pos).to_global(p, b.clone()).unwrap();
        let o = decode_attention_blocks(&q, (&kc, &vc), (&k, &v), &pos, scale, blocks).unwrap();
        let r = lay(
            &Tensor::from_vec(rows.clone(), [d.b, t, d.g, d.d]).unwrap(),
            &whole,
        );
        let mut caches = vec![kc];
        write_rows_in_place(&mut caches, &[&r], 1, rows_at).unwrap();
        assert_eq!(caches[0].nd_sbp(), Some(&split));
        (vals(&o), vals(&caches[0]))
    });
    let [_, kc, _, _, _] = tensors(d, &ops, DType::F64);
    let r = Tensor::from_vec(rows, [d.b, t, d.g, d.d]).unwrap();
    let cache_want = vals(&write_rows(&[&kc], &[&r], 1, rows_at).unwrap()[0]);
    for (rank, (o, cache)) in results.into_iter().enumerate() {
        let what = format!("rank {rank} on {p}, caches {split}, {blocks} blocks, {d:?}");
        close(&o, &want, 1e-12, &format!("blocks' attention, {what}"));
        close(
            &cache,
            &cache_want,
            0.0,
            &format!("rows into split caches, {what}"),
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 16, ..ProptestConfig::default() })]
    #[test]
    fn a_cache_split_on_its_positions_equals_one_rank(
        mesh in meshes(4, vec![vec![2, 2], vec![2, 1], vec![1, 3]]),
        perm in any::<u64>(),
        seq_axis in 0usize..2,
        per_rank in 1usize..3,
        per in 1usize..4,
        (b, (h, g), dh) in (1usize..4, prop::sample::select(vec![(1, 1), (4, 2), (6, 3)]), prop::sample::select(vec![2usize, 8])),
        seed in any::<u64>(),
        lseed in any::<u64>(),
        pos_at in 0.0f64..=1.0,
    ) {
        let seq = seq_axis.min(mesh.len() - 1);
        let blocks = mesh[seq] * per_rank;
        let p = blocks * per;
        let pos = ((p as f64) * pos_at).round() as usize;
        let d = Dims { b, h, g, d: dh, p, pos };
        split_cache_case(&placement(&mesh, perm), seq, d, blocks, seed, lseed);
    }
}
