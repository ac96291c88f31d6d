//! The decoding ops' CPU kernels: typed by the input's element type (16-bit ones computed in
//! f32, f64 in f64), rows in parallel.

use half::{bf16, f16};
use oxiflow_tensor::{CpuArray, CpuBackend, KernelIo, Result, TensorElement};
use rayon::prelude::*;

use super::op_types::{DecodeAttention, DecodeAttentionParts, RotaryAt, RotaryQkvAt, WriteRows};
use crate::cpu_dispatch::cpu_kernels_by_dtype;
use crate::host_slices::{input, kernel_err, output, Elem, Wide};

cpu_kernels_by_dtype! {
    [f32, f64, bf16, f16];
    pub(super) fn rotary_at(RotaryAt) => rotary_typed(op, name);
    pub(super) fn rotary_qkv_at(RotaryQkvAt) => rotary_qkv_typed(op, name);
    pub(super) fn decode_attention(DecodeAttention) => attention_typed(op, name);
    pub(super) fn decode_attention_parts(DecodeAttentionParts) => parts_typed(op, name);
}

/// The position held by input `i` (one i64).
fn position(op: &'static str, x: &[&CpuArray], i: usize) -> Result<usize> {
    let p = input::<i64>(op, x, i)?;
    match p.first() {
        Some(&v) if v >= 0 && p.len() == 1 => Ok(v as usize),
        _ => Err(kernel_err(
            op,
            format!("the position must be one i64 >= 0, got {p:?}"),
        )),
    }
}

fn rotary_typed<T: Elem>(
    _op: &RotaryAt,
    name: &'static str,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let dims = io.inputs[0].shape().to_vec();
    let &[_, t, h, d] = dims.as_slice() else {
        return Err(kernel_err(
            name,
            format!("x must be [B, T, H, D], got {dims:?}"),
        ));
    };
    let x = input::<T>(name, io.inputs, 0)?;
    let freq = input::<f64>(name, io.inputs, 1)?;
    let p0 = position(name, io.inputs, 2)?;
    let half = d / 2;
    if freq.len() != half {
        return Err(kernel_err(
            name,
            format!("{} frequencies for D = {d}", freq.len()),
        ));
    }
    let y = output::<T>(name, io.outputs, 0, x.len())?;
    let row = (h * d).max(1);
    y.par_chunks_mut(row)
        .zip(x.par_chunks(row))
        .enumerate()
        .for_each(|(r, (yr, xr))| {
            let pos = (p0 + r % t.max(1)) as f64;
            for (yh, xh) in yr.chunks_mut(d).zip(xr.chunks(d)) {
                rotate_head(xh, yh, &freq, pos);
            }
        });
    Ok(())
}

/// Head `xh` rotated for `pos` by `freq` into `yh` (pairs (i, i + D/2)).
fn rotate_head<T: Elem>(xh: &[T], yh: &mut [T], freq: &[f64], pos: f64) {
    let half = freq.len();
    for i in 0..half {
        let angle = pos * freq[i];
        let (s, c) = (T::W::constant(angle.sin()), T::W::constant(angle.cos()));
        let (a, b) = (xh[i].widen(), xh[i + half].widen());
        yh[i] = T::narrow(a * c - b * s);
        yh[i + half] = T::narrow(a * s + b * c);
    }
}

fn rotary_qkv_typed<T: Elem>(
    _op: &RotaryQkvAt,
    name: &'static str,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let dims = io.inputs[0].shape().to_vec();
    let &[_, t, g, r2, d] = dims.as_slice() else {
        return Err(kernel_err(
            name,
            format!("qkv must be [B, T, G, R + 2, D], got {dims:?}"),
        ));
    };
    let x = input::<T>(name, io.inputs, 0)?;
    let freq = input::<f64>(name, io.inputs, 1)?;
    let p0 = position(name, io.inputs, 2)?;
    if freq.len() * 2 != d || r2 < 3 {
        return Err(kernel_err(
            name,
            format!("{} frequencies for qkv {dims:?}", freq.len()),
        ));
    }
    let r = r2 - 2;
    let rows = x.len() / (g * r2 * d).max(1);
    let [qo, ko, vo] = io.outputs else {
        return Err(kernel_err(name, "expects 3 outputs".into()));
    };
    let q = output::<T>(name, std::slice::from_mut(qo), 0, rows * g * r * d)?;
    let k = output::<T>(name, std::slice::from_mut(ko), 0, rows * g * d)?;
    let v = output::<T>(name, std::slice::from_mut(vo), 0, rows * g * d)?;
    // Row (b, t) of every output, beside its input row: its groups' heads in order.
    let q_rows = q.par_chunks_mut((g * r * d).max(1));
    let k_rows = k.par_chunks_mut((g * d).max(1));
    let v_rows = v.par_chunks_mut((g * d).max(1));
    q_rows
        .zip(k_rows)
        .zip(v_rows)
        .zip(x.par_chunks((g * r2 * d).max(1)))
        .enumerate()
        .for_each(|(row, (((qr, kr), vr), xr))| {
            let pos = (p0 + row % t.max(1)) as f64;
            for (gi, xg) in xr.chunks(r2 * d).enumerate() {
                for j in 0..r {
                    let at = (gi * r + j) * d;
                    rotate_head(&xg[j * d..(j + 1) * d], &mut qr[at..at + d], &freq, pos);
                }
                let kh = &mut kr[gi * d..(gi + 1) * d];
                rotate_head(&xg[r * d..(r + 1) * d], kh, &freq, pos);
                vr[gi * d..(gi + 1) * d].copy_from_slice(&xg[(r + 1) * d..]);
            }
        });
    Ok(())
}

fn attention_typed<T: Elem>(
    op: &DecodeAttention,
    name: &'static str,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let (qd, cd) = (io.inputs[0].shape().to_vec(), io.inputs[1].shape().to_vec());
    let (&[_, _, h, d], &[_, p_len, g, _]) = (qd.as_slice(), cd.as_slice()) else {
        return Err(kernel_err(name, format!("q {qd:?} and caches {cd:?}")));
    };
    let [q, kc, vc, k, v] = [0, 1, 2, 3, 4].map(|i| input::<T>(name, io.inputs, i));
    let (q, kc, vc, k, v) = (q?, kc?, vc?, k?, v?);
    let pos = position(name, io.inputs, 5)?;
    if pos > p_len {
        return Err(kernel_err(
            name,
            format!("position {pos} is past the cache's {p_len} positions"),
        ));
    }
    let y = output::<T>(name, io.outputs, 0, q.len())?;
    let group = h / g.max(1);
    let scale = T::W::constant(op.scale);
    y.par_chunks_mut(d.max(1))
        .enumerate()
        .for_each(|(bh, out)| {
            let (bi, hi) = (bh / h, bh % h);
            let rows = HeadRows {
                cache: (&kc, &vc),
                new: (&k, &v),
                first: (bi * p_len) * g + hi / group.max(1),
                new_at: bi * g + hi / group.max(1),
                stride: g,
                d,
            };
            let s = attend_keys(&q[bh * d..(bh + 1) * d], &rows, (pos, true), scale);
            for (o, a) in out.iter_mut().zip(s.acc) {
                *o = T::narrow(a / s.total);
            }
        });
    Ok(())
}

fn parts_typed<T: Elem>(
    op: &DecodeAttentionParts,
    name: &'static str,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let (qd, cd) = (io.inputs[0].shape().to_vec(), io.inputs[1].shape().to_vec());
    let od = io
        .outputs
        .first()
        .map(|o| o.shape().to_vec())
        .unwrap_or_default();
    let (&[_, _, h, d], &[_, p_len, g, _], &[_, nl, _, _]) =
        (qd.as_slice(), cd.as_slice(), od.as_slice())
    else {
        return Err(kernel_err(
            name,
            format!("q {qd:?}, caches {cd:?}, blocks {od:?}"),
        ));
    };
    let per = op.block_len(p_len, nl).map_err(|e| kernel_err(name, e))?;
    let [q, kc, vc, k, v] = [0, 1, 2, 3, 4].map(|i| input::<T>(name, io.inputs, i));
    let (q, kc, vc, k, v) = (q?, kc?, vc?, k?, v?);
    let pos = position(name, io.inputs, 5)?.min(op.blocks * per);
    let owner = op.owner(pos, per);
    let rows_out = q.len() / d.max(1) * nl;
    if io.outputs.len() != 2 {
        return Err(kernel_err(name, "expects 2 outputs".into()));
    }
    let (o_out, lse_out) = io.outputs.split_at_mut(1);
    let o = output::<T::W>(name, o_out, 0, rows_out * d)?;
    let lse = output::<T::W>(name, lse_out, 0, rows_out)?;
    let group = h / g.max(1);
    let scale = T::W::constant(op.scale);
    o.par_chunks_mut(d.max(1))
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each(|(r, (out, l))| {
            // Row r of o [B, nl, H, D]: sequence bi, local block cl, head hi.
            let (bi, cl, hi) = (r / (nl * h), r / h % nl, r % h);
            let block = op.first_block + cl;
            let cached = pos.saturating_sub(block * per).min(per);
            let rows = HeadRows {
                cache: (&kc, &vc),
                new: (&k, &v),
                first: (bi * p_len + cl * per) * g + hi / group.max(1),
                new_at: bi * g + hi / group.max(1),
                stride: g,
                d,
            };
            let qr = &q[(bi * h + hi) * d..(bi * h + hi + 1) * d];
            let s = attend_keys(qr, &rows, (cached, block == owner), scale);
            let empty = s.total <= T::W::constant(0.0);
            for (o, a) in out.iter_mut().zip(s.acc) {
                *o = if empty { a } else { a / s.total };
            }
            *l = if empty {
                T::W::constant(f64::NEG_INFINITY)
            } else {
                s.max + s.total.ln()
            };
        });
    Ok(())
}

/// Where one query head's key and value rows lie: the caches' rows `first + j * stride` (in
/// rows of `d`) for the cached keys, the new ones' row `new_at`.
struct HeadRows<'a, T> {
    cache: (&'a [T], &'a [T]),
    new: (&'a [T], &'a [T]),
    first: usize,
    new_at: usize,
    stride: usize,
    d: usize,
}

impl<T> HeadRows<'_, T> {
    /// Key (`value` false) or value row `j`: cached for `j < cached`, else the new one.
    fn row(&self, value: bool, j: usize, cached: usize) -> &[T] {
        let (src, at) = match (j < cached, value) {
            (true, false) => (self.cache.0, self.first + j * self.stride),
            (true, true) => (self.cache.1, self.first + j * self.stride),
            (false, false) => (self.new.0, self.new_at),
            (false, true) => (self.new.1, self.new_at),
        };
        &src[at * self.d..(at + 1) * self.d]
    }
}

/// One query head's softmax over its keys: the values weighted by exp(score - max), unscaled,
/// the largest score and the weights' sum (zeros, -inf and 0 over no keys).
struct Softmaxed<W> {
    acc: Vec<W>,
    max: W,
    total: W,
}

/// q's softmax over the `cached` keys `rows` holds and, `with_new`, the new one after them.
fn attend_keys<T: Elem>(
    q: &[T],
    rows: &HeadRows<'_, T>,
    (cached, with_new): (usize, bool),
    scale: T::W,
) -> Softmaxed<T::W> {
    let n = cached + usize::from(with_new);
    let zero = T::W::constant(0.0);
    let scores: Vec<T::W> = (0..n)
        .map(|j| {
            let dot = q
                .iter()
                .zip(rows.row(false, j, cached))
                .fold(zero, |a, (x, y)| a + x.widen() * y.widen());
            dot * scale
        })
        .collect();
    let max =
        scores.iter().copied().fold(
            T::W::constant(f64::NEG_INFINITY),
            |a, s| if s > a { s } else { a },
        );
    let mut acc = vec![zero; rows.d];
    let mut total = zero;
    for (j, &s) in scores.iter().enumerate() {
        let w = (s - max).exp();
        total = total + w;
        for (a, x) in acc.iter_mut().zip(rows.row(true, j, cached)) {
            *a = *a + w * x.widen();
        }
    }
    Softmaxed { acc, max, total }
}

cpu_kernels_by_dtype! {
    [f32, f64, bf16, f16, i64];
    pub(super) fn write_rows(WriteRows) => rows_typed(op, name);
}

fn rows_typed<T: TensorElement + Copy + Send + Sync>(
    op: &WriteRows,
    name: &'static str,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let n = io.outputs.len();
    if io.inputs.len() != 2 * n {
        return Err(kernel_err(
            name,
            format!("{} inputs for {n} caches", io.inputs.len()),
        ));
    }
    for i in 0..n {
        let dims = io.inputs[i].shape().to_vec();
        let rdims = io.inputs[n + i].shape().to_vec();
        let (Some(&len), Some(&t)) = (dims.get(op.dim), rdims.get(op.dim)) else {
            return Err(kernel_err(name, format!("cache {dims:?}, rows {rdims:?}")));
        };
        let (first, count) = op.rows_written(t);
        if op.at + count > len || first + count > t {
            return Err(kernel_err(
                name,
                format!(
                    "rows {first}..{} of {rdims:?} from {} overrun cache {dims:?}",
                    first + count,
                    op.at
                ),
            ));
        }
        let inner: usize = dims[op.dim + 1..].iter().product();
        let cache = input::<T>(name, io.inputs, i)?;
        let rows = input::<T>(name, io.inputs, n + i)?;
        let out = output::<T>(name, io.outputs, i, cache.len())?;
        out.copy_from_slice(&cache);
        let (block, written) = (len * inner, count * inner);
        if written == 0 {
            continue;
        }
        for (o, r) in out.chunks_mut(block.max(1)).zip(rows.chunks(t * inner)) {
            o[op.at * inner..op.at * inner + written]
                .copy_from_slice(&r[first * inner..first * inner + written]);
        }
    }
    Ok(())
}
