//! The CPU kernels of context attention. Each rank's pieces are read into heads-first f64
//! arrays; the ring passes K/V blocks (and, backward, their dK/dV) in f64 between the members of
//! the sequence split, sending the next block on a scoped thread while the block in hand is
//! attended to. Scores are masked by token position (the op's `SeqOrder`), softmax statistics
//! merge online per block, and results round once to the output dtype (16-bit data keeps its
//! statistics in f32). (batch, head) rows run in
//! parallel; the backward runs one task per (batch, kv head) so a GQA group's dK/dV sum in one
//! place.

use ndarray::ArrayD;
use oxiflow_dtype::{bf16, f16, Element};
use oxiflow_tensor::{CpuArray, CpuBackend, ExternOp, KernelIo, Peers, Result, TensorElement};
use rayon::prelude::*;

use super::{CpAttention, Dims, RankCall};
use crate::cpu_dispatch::cpu_kernels_by_dtype;
use crate::host_slices::{input_array, kernel_err};

/// An element type the kernels read and write (computed in f64, rounded once on the way out),
/// and the dtype of its softmax statistics: f32 for 16-bit data.
trait Elem: TensorElement {
    type Stats: TensorElement;
}
impl Elem for f32 {
    type Stats = f32;
}
impl Elem for f64 {
    type Stats = f64;
}
impl Elem for bf16 {
    type Stats = f32;
}
impl Elem for f16 {
    type Stats = f32;
}

/// `x` `[b, t, h, d]` (row-major, as f64) to `[b, h, t, d]`.
fn heads_first<T: Elem>(op: &'static str, x: &ArrayD<T>) -> Result<Vec<f64>> {
    if x.ndim() != 4 {
        return Err(kernel_err(
            op,
            format!("an input is {:?}, not 4-d", x.shape()),
        ));
    }
    let p = x.view().permuted_axes(vec![0, 2, 1, 3]);
    Ok(p.iter().map(|v| v.to_f64()).collect())
}

/// Writes `x` `[b, h, t, d]` into output `out` `[b, t, h, d]` of `T`.
fn write_heads_last<T: Elem>(
    op: &'static str,
    x: &[f64],
    dims: [usize; 4],
    out: &mut CpuArray,
) -> Result<()> {
    let [b, h, t, d] = dims;
    let a =
        T::view_mut(out).ok_or_else(|| kernel_err(op, format!("an output is not {}", T::DTYPE)))?;
    if a.shape() != [b, t, h, d] {
        return Err(kernel_err(
            op,
            format!("an output is {:?}, expected {:?}", a.shape(), [b, t, h, d]),
        ));
    }
    let mut p = a.view_mut().permuted_axes(vec![0, 2, 1, 3]);
    for (o, &v) in p.iter_mut().zip(x) {
        *o = T::from_f64(v);
    }
    Ok(())
}

/// What one rank's call knows: its local sizes (t: its rows), the ring, the token position of
/// every row of each member's block, and the attributes.
struct Call<'a> {
    name: &'static str,
    dims: Dims,
    peers: &'a Peers,
    block_pos: Vec<Vec<usize>>,
    causal: bool,
    scale: f64,
}

impl Call<'_> {
    fn rows(&self, block: usize) -> usize {
        self.block_pos[block].len()
    }
    /// The block held at ring step `s` (step 0: this rank's own).
    fn block_at(&self, s: usize) -> usize {
        let n = self.peers.len();
        (self.peers.me() + n - s % n) % n
    }
    /// Whether key position `pk` is masked for query position `pq`.
    fn masked(&self, pq: usize, pk: usize) -> bool {
        self.causal && pk > pq
    }
}

fn setup<'a, T: Elem>(op: &'a CpAttention, x: &'a [&'a CpuArray]) -> Result<Call<'a>> {
    let name = op.name();
    let (q, k, v) = (
        input_array::<T>(name, x, 0)?,
        input_array::<T>(name, x, 1)?,
        input_array::<T>(name, x, 2)?,
    );
    let RankCall {
        dims,
        peers,
        block_pos,
    } = op
        .rank_call(q.shape(), k.shape(), v.shape())
        .map_err(|e| kernel_err(name, e))?;
    Ok(Call {
        name,
        dims,
        peers,
        block_pos,
        causal: op.attrs.causal,
        scale: op.attrs.scale.get(),
    })
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Sends `blocks` to the next member and returns the previous member's, of `lens` elements,
/// on a scoped thread of `scope`.
fn shift_blocks<'s>(
    scope: &'s std::thread::Scope<'s, '_>,
    c: &'s Call<'_>,
    blocks: [&'s [f64]; 2],
    lens: [usize; 2],
) -> std::thread::ScopedJoinHandle<'s, Result<[Vec<f64>; 2]>> {
    scope.spawn(move || {
        let mut got = [vec![0.0; lens[0]], vec![0.0; lens[1]]];
        for (send, recv) in blocks.into_iter().zip(got.iter_mut()) {
            c.peers.shift(c.name, send, recv)?;
        }
        Ok(got)
    })
}

fn joined<T>(c: &Call<'_>, h: std::thread::ScopedJoinHandle<'_, Result<T>>) -> Result<T> {
    h.join()
        .map_err(|_| kernel_err(c.name, "the ring's exchange thread panicked".into()))?
}

/// Ring step `s`: runs `work` on the K/V block in hand (its index and `kv`) while the next
/// block arrives, then leaves the next block in `kv`; returns the next block's K and V sizes.
fn ring_step(
    c: &Call<'_>,
    s: usize,
    kv: &mut [Vec<f64>; 2],
    work: impl FnOnce(usize, [&[f64]; 2]),
) -> Result<[usize; 2]> {
    let Dims { b, hkv, d, dv, .. } = c.dims;
    let (blk, next) = (c.block_at(s), c.block_at(s + 1));
    let lens = [b * hkv * c.rows(next) * d, b * hkv * c.rows(next) * dv];
    let got = std::thread::scope(|scope| {
        let last = s + 1 >= c.peers.len();
        let handle = (!last).then(|| shift_blocks(scope, c, [&kv[0], &kv[1]], lens));
        work(blk, [&kv[0], &kv[1]]);
        handle.map(|h| joined(c, h)).transpose()
    })?;
    if let Some(got) = got {
        *kv = got;
    }
    Ok(lens)
}

/// The online-softmax state of every (batch, head, row): max, sum, unnormalised output.
struct Online {
    m: Vec<f64>,
    l: Vec<f64>,
    acc: Vec<f64>,
}

/// Folds block `blk` (keys `kb`, values `vb`, heads-first) into the state.
fn attend_block(c: &Call<'_>, qf: &[f64], kb: &[f64], vb: &[f64], blk: usize, st: &mut Online) {
    let Dims {
        t, h, hkv, d, dv, ..
    } = c.dims;
    let (tk, ratio) = (c.rows(blk), h / hkv);
    let (pos_q, pos_k) = (&c.block_pos[c.peers.me()], &c.block_pos[blk]);
    st.m.par_chunks_mut(t.max(1))
        .zip(st.l.par_chunks_mut(t.max(1)))
        .zip(st.acc.par_chunks_mut((t * dv).max(1)))
        .enumerate()
        .for_each(|(bh, ((m, l), acc))| {
            let (bi, g) = (bh / h, (bh % h) / ratio);
            let kbase = (bi * hkv + g) * tk;
            let mut scores = vec![f64::NEG_INFINITY; tk];
            for i in 0..t {
                let qi = &qf[(bh * t + i) * d..][..d];
                let mut mb = f64::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = if c.masked(pos_q[i], pos_k[j]) {
                        f64::NEG_INFINITY
                    } else {
                        c.scale * dot(qi, &kb[(kbase + j) * d..][..d])
                    };
                    mb = mb.max(*s);
                }
                if mb == f64::NEG_INFINITY {
                    continue;
                }
                let mn = m[i].max(mb);
                let alpha = (m[i] - mn).exp();
                let row = &mut acc[i * dv..][..dv];
                l[i] *= alpha;
                row.iter_mut().for_each(|a| *a *= alpha);
                for (j, &s) in scores.iter().enumerate() {
                    if s == f64::NEG_INFINITY {
                        continue;
                    }
                    let p = (s - mn).exp();
                    l[i] += p;
                    let vj = &vb[(kbase + j) * dv..][..dv];
                    row.iter_mut().zip(vj).for_each(|(a, v)| *a += p * v);
                }
                m[i] = mn;
            }
        });
}

fn forward_typed<T: Elem>(op: &CpAttention, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let c = setup::<T>(op, io.inputs)?;
    let Dims { b, t, h, dv, .. } = c.dims;
    let qf = heads_first(c.name, input_array::<T>(c.name, io.inputs, 0)?)?;
    let mut kv = [
        heads_first(c.name, input_array::<T>(c.name, io.inputs, 1)?)?,
        heads_first(c.name, input_array::<T>(c.name, io.inputs, 2)?)?,
    ];
    let mut st = Online {
        m: vec![f64::NEG_INFINITY; b * h * t],
        l: vec![0.0; b * h * t],
        acc: vec![0.0; b * h * t * dv],
    };
    for s in 0..c.peers.len() {
        ring_step(&c, s, &mut kv, |blk, [k, v]| {
            attend_block(&c, &qf, k, v, blk, &mut st)
        })?;
    }
    let mut lse = vec![0.0; b * h * t];
    for (r, x) in lse.iter_mut().enumerate() {
        let l = st.l[r];
        *x = if l > 0.0 {
            st.m[r] + l.ln()
        } else {
            f64::NEG_INFINITY
        };
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        st.acc[r * dv..][..dv].iter_mut().for_each(|a| *a *= inv);
    }
    let [o, lse_out] = io.outputs else {
        return Err(kernel_err(
            c.name,
            format!("expects 2 outputs, got {}", io.outputs.len()),
        ));
    };
    write_heads_last::<T>(c.name, &st.acc, [b, h, t, dv], o)?;
    let a = T::Stats::view_mut(lse_out)
        .ok_or_else(|| kernel_err(c.name, "lse has another dtype".into()))?;
    if a.len() != lse.len() {
        return Err(kernel_err(
            c.name,
            format!("lse holds {}, expected {}", a.len(), lse.len()),
        ));
    }
    a.iter_mut()
        .zip(&lse)
        .for_each(|(o, &x)| *o = T::Stats::from_f64(x));
    Ok(())
}

/// The backward's per-row inputs: queries, output gradients, log-sum-exps and `dO . o`.
struct Rows {
    qf: Vec<f64>,
    dof: Vec<f64>,
    lse: Vec<f64>,
    delta: Vec<f64>,
}

/// Adds block `blk`'s contributions to dq (all heads) and to the block's dk, dv.
fn grad_block(
    c: &Call<'_>,
    rows: &Rows,
    kv: [&[f64]; 2],
    blk: usize,
    dq: &mut [f64],
    dkv: &mut [Vec<f64>; 2],
) {
    let Dims {
        t, h, hkv, d, dv, ..
    } = c.dims;
    let (tk, ratio) = (c.rows(blk), h / hkv);
    let (pos_q, pos_k) = (&c.block_pos[c.peers.me()], &c.block_pos[blk]);
    let [dk, dvv] = dkv;
    dq.par_chunks_mut((ratio * t * d).max(1))
        .zip(dk.par_chunks_mut((tk * d).max(1)))
        .zip(dvv.par_chunks_mut((tk * dv).max(1)))
        .enumerate()
        .for_each(|(bg, ((dq, dk), dvv))| {
            let (bi, g) = (bg / hkv, bg % hkv);
            let (kb, vb) = (&kv[0][bg * tk * d..], &kv[1][bg * tk * dv..]);
            for r in 0..ratio {
                let bh = bi * h + g * ratio + r;
                for i in 0..t {
                    let row = bh * t + i;
                    let (lse, delta) = (rows.lse[row], rows.delta[row]);
                    if lse == f64::NEG_INFINITY {
                        continue;
                    }
                    let qi = &rows.qf[row * d..][..d];
                    let doi = &rows.dof[row * dv..][..dv];
                    let dqi = &mut dq[(r * t + i) * d..][..d];
                    for j in 0..tk {
                        if c.masked(pos_q[i], pos_k[j]) {
                            continue;
                        }
                        let kj = &kb[j * d..][..d];
                        let vj = &vb[j * dv..][..dv];
                        let p = (c.scale * dot(qi, kj) - lse).exp();
                        let ds = p * (dot(doi, vj) - delta) * c.scale;
                        dvv[j * dv..][..dv]
                            .iter_mut()
                            .zip(doi)
                            .for_each(|(a, x)| *a += p * x);
                        dqi.iter_mut().zip(kj).for_each(|(a, x)| *a += ds * x);
                        dk[j * d..][..d]
                            .iter_mut()
                            .zip(qi)
                            .for_each(|(a, x)| *a += ds * x);
                    }
                }
            }
        });
}

fn backward_typed<T: Elem>(op: &CpAttention, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let c = setup::<T>(op, io.inputs)?;
    let Dims {
        b,
        t,
        h,
        hkv,
        d,
        dv,
    } = c.dims;
    let name = c.name;
    let of = heads_first(name, input_array::<T>(name, io.inputs, 3)?)?;
    let dof = heads_first(name, input_array::<T>(name, io.inputs, 4)?)?;
    let lse_in = input_array::<T::Stats>(name, io.inputs, 5)?;
    if of.len() != b * h * t * dv || dof.len() != of.len() || lse_in.len() != b * h * t {
        return Err(kernel_err(name, "o, dO or lse do not fit q and v".into()));
    }
    let delta = (0..b * h * t)
        .map(|r| dot(&of[r * dv..][..dv], &dof[r * dv..][..dv]))
        .collect();
    let rows = Rows {
        qf: heads_first(name, input_array::<T>(name, io.inputs, 0)?)?,
        dof,
        lse: lse_in.iter().map(|x| x.to_f64()).collect(),
        delta,
    };
    let mut kv = [
        heads_first(name, input_array::<T>(name, io.inputs, 1)?)?,
        heads_first(name, input_array::<T>(name, io.inputs, 2)?)?,
    ];
    let mut dkv = [vec![0.0; kv[0].len()], vec![0.0; kv[1].len()]];
    let mut dq = vec![0.0; b * h * t * d];
    for s in 0..c.peers.len() {
        let lens = ring_step(&c, s, &mut kv, |blk, kvb| {
            grad_block(&c, &rows, kvb, blk, &mut dq, &mut dkv)
        })?;
        // dK/dV travel with their block; the last step brings this rank's own home.
        let mut back = [vec![0.0; lens[0]], vec![0.0; lens[1]]];
        for (send, recv) in dkv.iter().zip(back.iter_mut()) {
            c.peers.shift(name, send, recv)?;
        }
        dkv = back;
    }
    let [dq_out, dk_out, dv_out] = io.outputs else {
        return Err(kernel_err(
            name,
            format!("expects 3 outputs, got {}", io.outputs.len()),
        ));
    };
    write_heads_last::<T>(name, &dq, [b, h, t, d], dq_out)?;
    write_heads_last::<T>(name, &dkv[0], [b, hkv, t, d], dk_out)?;
    write_heads_last::<T>(name, &dkv[1], [b, hkv, t, dv], dv_out)
}

cpu_kernels_by_dtype! {
    [f32, f64, bf16, f16];
    pub(super) fn forward(CpAttention) => forward_typed;
    pub(super) fn backward(CpAttention) => backward_typed;
}
