//! The decoding ops' CUDA kernels (through the library's NVRTC path) against the CPU kernels
//! in f64 on the same (rounded) values: attention over caches of up to 300 positions with
//! grouped-query heads of width 64 and 128, the position at the start, inside and at the end
//! of the cache; rotary at a device position; rows written into a cache held only by the
//! caller in its own memory (the same piece after), and into a new one when another handle
//! holds it (that handle's value unchanged); the blocks' attention (the cache cut into blocks,
//! each attended to apart, merged) against the same f64 attention, and a window of rows written
//! (a rank's part of a cache split on positions), new and in place. Every float dtype; without
//! a CUDA device it prints that it was skipped.

mod common;

use common::{close, position, rotary_frequencies, vals};

use oxiflow_ops::decode::{
    decode_attention, decode_attention_blocks, rotary_at, rotary_qkv_at, write_rows_in_place,
    WriteRows,
};
use oxiflow_tensor::capture::piece_of;
use oxiflow_tensor::{dispatch_into, dispatch_multi, DType, Extern, NdSbp, Placement, Sbp, Tensor};

fn on(t: &Tensor, p: &Placement, nd: &NdSbp) -> Tensor {
    t.to_global(p, NdSbp::broadcast(1))
        .unwrap()
        .to_global(p, nd.clone())
        .unwrap()
}

/// Never-zero values in (-1.5, -0.1] U [0.1, 1.5) from `seed`.
fn values(n: usize, seed: u64) -> Vec<f64> {
    let r = Tensor::rand([n], seed, DType::F64).to_vec::<f64>().unwrap();
    r.iter()
        .enumerate()
        .map(|(i, u)| (0.1 + 1.4 * u) * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect()
}

/// A host tensor of `shape` holding [`values`] from `seed`, rounded to `dt`.
fn host_values(shape: Vec<usize>, seed: u64, dt: DType) -> Tensor {
    Tensor::from_vec(values(shape.iter().product(), seed), shape)
        .unwrap()
        .cast(dt)
        .unwrap()
}

/// The values of a cache `[b, plen, row]` with `rows` `[b, 1, row]` written at position `at`.
fn with_rows_at(
    mut cache: Vec<f64>,
    rows: &[f64],
    (b, plen, row): (usize, usize, usize),
    at: usize,
) -> Vec<f64> {
    for bi in 0..b {
        let o = (bi * plen + at) * row;
        cache[o..o + row].copy_from_slice(&rows[bi * row..(bi + 1) * row]);
    }
    cache
}

/// The rotary base of Llama 3.
const LLAMA3_BASE: f64 = 500_000.0;

/// Asserts the values of `t` are `want`, exactly.
fn assert_values(t: &Tensor, want: &[f64], what: &str) {
    close(&vals(t), want, 0.0, what);
}

fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F64 => 1e-12,
        DType::F32 => 2e-5,
        _ => 2e-2,
    }
}

#[test]
fn decoding_ops_on_cuda_match_the_cpu_kernels_in_f64() {
    let Some((_world, p)) = common::cuda_device_or_skip("decode_cuda") else {
        return;
    };
    let b1 = NdSbp::new([Sbp::B]);
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (b, h, g, d, plen, pos, seed) in [
            (1usize, 32usize, 8usize, 64usize, 300usize, 137usize, 1u64),
            (3, 4, 4, 128, 40, 0, 2),
            (2, 6, 2, 64, 17, 17, 3),
            (4, 8, 1, 32, 9, 5, 4),
            (1, 2, 1, 256, 70, 69, 5),
            (1, 4, 2, 64, 1100, 1050, 6),
            (2, 3, 1, 20, 45, 44, 7),
            (1, 2, 2, 24, 600, 599, 8),
        ] {
            let shapes = [
                vec![b, 1, h, d],
                vec![b, plen, g, d],
                vec![b, plen, g, d],
                vec![b, 1, g, d],
                vec![b, 1, g, d],
            ];
            let host: Vec<Tensor> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| host_values(s.clone(), seed * 10 + i as u64, dt))
                .collect();
            let wide: Vec<Tensor> = host.iter().map(|t| t.cast(DType::F64).unwrap()).collect();
            let scale = 1.0 / (d as f64).sqrt();
            let pos_host = position(pos);
            let attend = |x: &[Tensor], pos: &Tensor| {
                decode_attention(&x[0], (&x[1], &x[2]), (&x[3], &x[4]), pos, scale).unwrap()
            };
            let want = attend(&wide, &pos_host);
            let batch = NdSbp::new([Sbp::S(0)]);
            let dev: Vec<Tensor> = host.iter().map(|t| on(t, &p, &batch)).collect();
            let pos_dev = on(&pos_host, &p, &b1);
            let got = attend(&dev, &pos_dev);
            let what = format!("decode_attention {dt} b{b} h{h} g{g} d{d} P{plen} pos{pos}");
            close(&vals(&got), &vals(&want), tolerance(dt), &what);
            // The same by blocks of the cache: empty blocks after the position, the one
            // holding it, and full ones before.
            let blocks = [4, 3, 5, 2, 7, 17]
                .into_iter()
                .find(|c| plen % c == 0)
                .unwrap_or(1);
            let by_blocks = decode_attention_blocks(
                &dev[0],
                (&dev[1], &dev[2]),
                (&dev[3], &dev[4]),
                &pos_dev,
                scale,
                blocks,
            )
            .unwrap();
            assert_eq!(by_blocks.dtype(), dt);
            close(
                &vals(&by_blocks),
                &vals(&want),
                tolerance(dt),
                &format!("{what} in {blocks} blocks"),
            );

            // Rotary at the device position, frequencies of a Llama-3 base.
            let f = rotary_frequencies(d, LLAMA3_BASE);
            let want = rotary_at(&wide[0], &f, &pos_host).unwrap();
            let got = rotary_at(&dev[0], &on(&f, &p, &b1), &pos_dev).unwrap();
            close(
                &vals(&got),
                &vals(&want),
                tolerance(dt).max(1e-6),
                &format!("rotary_at {what}"),
            );

            // Rows into a cache only the caller holds: its own memory, the same piece after.
            let at = pos.min(plen - 1);
            let mut caches = vec![dev[1].clone(), dev[2].clone()];
            drop(dev);
            let before = caches[0].clone();
            let want = with_rows_at(
                wide[1].to_vec::<f64>().unwrap(),
                &wide[3].to_vec::<f64>().unwrap(),
                (b, plen, g * d),
                at,
            );
            let rk = on(&host[3], &p, &batch);
            let rv = on(&host[4], &p, &batch);
            // Another handle holds the key cache: a new tensor, the held one unchanged.
            write_rows_in_place(&mut caches, &[&rk, &rv], 1, at).unwrap();
            assert!(
                !caches[0].shares_piece(&before),
                "{what}: a held cache was written"
            );
            assert_values(&before, &vals(&wide[1]), &format!("held cache {what}"));
            assert_values(&caches[0], &want, &format!("new cache {what}"));
            drop(before);
            // Held by the caller alone now: written in its own memory (the same piece).
            let address = |t: &Tensor| piece_of(t).map(|p| std::sync::Arc::as_ptr(p) as usize);
            let was = address(&caches[0]);
            assert!(write_rows_in_place(&mut caches, &[&rk, &rv], 1, at).unwrap());
            assert_eq!(address(&caches[0]), was, "{what}: not written in place");
            assert_values(&caches[0], &want, &format!("cache in place {what}"));
        }
    }
}

/// Seventy caches written in their own memory by one call (two launches of a table of
/// caches): every cache gets its own rows at the position, and nothing else changes.
#[test]
fn many_caches_are_written_in_place_each_with_its_own_rows() {
    let Some((_world, p)) = common::cuda_device_or_skip("decode_cuda") else {
        return;
    };
    let batch = NdSbp::new([Sbp::S(0)]);
    let (b, plen, g, d, at, n) = (2usize, 5usize, 3usize, 4usize, 3usize, 70usize);
    for dt in [DType::F32, DType::F64, DType::BF16] {
        let host_caches: Vec<Tensor> = (0..n)
            .map(|i| host_values(vec![b, plen, g, d], 100 + i as u64, dt))
            .collect();
        let host_rows: Vec<Tensor> = (0..n)
            .map(|i| host_values(vec![b, 1, g, d], 900 + i as u64, dt))
            .collect();
        let mut caches: Vec<Tensor> = host_caches.iter().map(|t| on(t, &p, &batch)).collect();
        let rows: Vec<Tensor> = host_rows.iter().map(|t| on(t, &p, &batch)).collect();
        let row_refs: Vec<&Tensor> = rows.iter().collect();
        assert!(write_rows_in_place(&mut caches, &row_refs, 1, at).unwrap());
        for i in 0..n {
            let want = with_rows_at(
                vals(&host_caches[i]),
                &vals(&host_rows[i]),
                (b, plen, g * d),
                at,
            );
            assert_values(&caches[i], &want, &format!("{dt} cache {i} of {n}"));
        }
    }
}

/// Rows 1..3 of three written at positions 2..4 of a cache of six (the window a rank's part of
/// a cache split on its positions writes): into a new cache, then in the cache's own memory.
#[test]
fn a_window_of_rows_lands_at_its_positions() {
    let Some((_world, p)) = common::cuda_device_or_skip("decode_cuda") else {
        return;
    };
    let batch = NdSbp::new([Sbp::S(0)]);
    let (b, plen, t, inner) = (2usize, 6usize, 3usize, 5usize);
    let op = WriteRows {
        dim: 1,
        at: 2,
        window: Some((1, 2)),
    };
    for dt in [DType::F32, DType::F64, DType::BF16] {
        let cache = host_values(vec![b, plen, inner], 41, dt);
        let rows = host_values(vec![b, t, inner], 42, dt);
        let mut want = vals(&cache);
        let r = vals(&rows);
        for bi in 0..b {
            for j in 0..2 {
                let (to, from) = (((bi * plen) + 2 + j) * inner, ((bi * t) + 1 + j) * inner);
                want[to..to + inner].copy_from_slice(&r[from..from + inner]);
            }
        }
        let (c, r) = (on(&cache, &p, &batch), on(&rows, &p, &batch));
        let new = dispatch_multi(Extern::new(op).into(), &[&c, &r]).unwrap();
        assert_values(&new[0], &want, &format!("{dt} window, new cache"));
        drop(new);
        assert!(dispatch_into(Extern::new(op).into(), &[&c, &r], &[&c]).unwrap());
        assert_values(&c, &want, &format!("{dt} window, in place"));
    }
}

/// The split and rotation of a fused query/key/value projection on the device against the
/// CPU kernel in f64 on the same (rounded) values: Llama-1B's groups (8 of 4 query heads of
/// 64) at batch 1 and 16, and small odd shapes, every float dtype.
#[test]
fn rotary_qkv_on_cuda_matches_the_cpu_kernel_in_f64() {
    let Some((_world, p)) = common::cuda_device_or_skip("decode_cuda") else {
        return;
    };
    let (b1, batch) = (NdSbp::new([Sbp::B]), NdSbp::new([Sbp::S(0)]));
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (b, t, g, r, d, pos, seed) in [
            (1usize, 1usize, 8usize, 4usize, 64usize, 200usize, 1u64),
            (16, 1, 8, 4, 64, 383, 2),
            (2, 3, 3, 1, 6, 0, 3),
            (3, 2, 1, 5, 128, 77, 4),
        ] {
            let shape = vec![b, t, g, r + 2, d];
            let x = host_values(shape, seed, dt);
            let f = rotary_frequencies(d, LLAMA3_BASE);
            let pos_host = position(pos);
            let (wq, wk, wv) = rotary_qkv_at(&x.cast(DType::F64).unwrap(), &f, &pos_host).unwrap();
            let (q, k, v) = rotary_qkv_at(
                &on(&x, &p, &batch),
                &on(&f, &p, &b1),
                &on(&pos_host, &p, &b1),
            )
            .unwrap();
            let what = format!("rotary_qkv_at {dt} b{b} t{t} g{g} r{r} d{d} pos{pos}");
            let tol = tolerance(dt).max(1e-6);
            close(&vals(&q), &vals(&wq), tol, &format!("q {what}"));
            close(&vals(&k), &vals(&wk), tol, &format!("k {what}"));
            assert_values(&v, &vals(&wv), &format!("v {what}"));
        }
    }
}
