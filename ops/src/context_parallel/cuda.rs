//! The CUDA kernels of context attention: the CPU kernels' ring, with cuDNN's fused attention
//! (or the NVRTC flash kernels where cuDNN refuses a call, f32 among them) run once per pair of
//! token runs. A block's rows hold runs of consecutive token positions (one per member in the
//! natural order, two in the load-balanced one); under the causal mask a query run attends to a
//! key run wholly before it in full, to itself causally, and not at all to one after it, so the
//! fused kernels' own masks are all it needs. Partial outputs fold into an f32 accumulator by
//! their log-sum-exps (`cp.cu`).
//!
//! K/V blocks move over NCCL, one grouped send/receive per step on the ring's communicator
//! stream, posted before the block in hand is attended to; the compute stream waits for the next
//! block only when it reads it. The backward's ring carries each block's f32 dK/dV accumulators
//! with it: a step's contributions add into the accumulator that arrived for its block, which
//! then moves on, and the last step brings this rank's own home. Grouped-query heads: the held
//! block's K/V heads are repeated once per step into scratch, and dK/dV per query head sum into
//! their group. Every buffer is scratch the executor allocates from the op's declaration. The
//! call's runs, pairs and scratch layout are `cuda_plan`'s, the glue launches `cuda_glue`'s and
//! the exchanges `cuda_ring`'s.
//!
//! The fused kernels take one length for queries and keys, so the runs are cut into pieces of
//! one length (the largest dividing them all); a sequence that would need more than 64
//! pieces (`cuda_plan::MAX_RUNS`: lengths that do not split evenly) is refused by every rank before
//! anything moves, as are value heads of another width than key heads.

use std::sync::Arc;

use cudarc::driver::CudaEvent;
use oxiflow_cuda::kernel_layer::{
    attention_backward, attention_forward, AttentionBackward, AttentionForward, AttentionShape,
    Bhtd, FloatType,
};
use oxiflow_cuda::{device_error, CudaKernels, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, KernelIo, Result};

use super::cuda_glue::Glue;
use super::cuda_plan::{layout, Layout, Plan};
use super::cuda_ring::Ring;
use super::{CpAttention, Dims, Pass};
use crate::kernel_io::expect;
use crate::operand_dtypes::cuda_float_type;

pub(super) use super::cuda_plan::scratch;

/// Rows `at ..` of a `[B, rows, heads, e]` buffer at `ptr` (elements of `elem` bytes) as a
/// `[B, heads, .., e]` view.
fn rows_view(ptr: u64, elem: usize, rows: usize, heads: usize, e: usize, at: usize) -> Bhtd {
    Bhtd::bthd(ptr + (at * heads * e * elem) as u64, rows, heads, e)
}

/// What both passes check and derive before anything runs.
struct Call<'a> {
    plan: Plan<'a>,
    layout: Layout,
    glue: Glue<'a>,
    dtype: FloatType,
    elem: usize,
    base: u64,
}

fn call<'a>(
    op: &'a CpAttention,
    b: &'a CudaKernels,
    q: &CudaStorage,
    (k, v): (&CudaStorage, &CudaStorage),
    scratch: &CudaStorage,
) -> Result<Call<'a>> {
    let name = op.name();
    let dt = q.dtype();
    let dtype = cuda_float_type(name, dt)?;
    if k.dtype() != dt || v.dtype() != dt {
        return Err(device_error(
            name,
            format!("q {dt}, k {} and v {} differ", k.dtype(), v.dtype()),
        ));
    }
    let plan = Plan::new(op, q.shape().dims(), k.shape().dims(), v.shape().dims())
        .map_err(|e| device_error(name, e))?;
    let elem = dt.size();
    let layout = layout(&plan, elem, op.pass == Pass::Backward);
    if scratch.numel() * scratch.dtype().size() < layout.bytes {
        return Err(device_error(
            name,
            format!(
                "scratch of {} bytes for {} planned",
                scratch.numel() * scratch.dtype().size(),
                layout.bytes
            ),
        ));
    }
    Ok(Call {
        plan,
        layout,
        glue: Glue {
            rt: b.runtime(),
            name,
            dt,
        },
        dtype,
        elem,
        base: scratch.ptr(),
    })
}

impl Call<'_> {
    /// Starts moving the K/V block held at step `s` (at `held`) on to the next member, into
    /// this rank's region for step `s + 1`; the events of its arrival (none after the last
    /// step).
    fn pass_on_kv(
        &self,
        ring: &mut Ring<'_>,
        s: usize,
        held: (u64, u64),
    ) -> Result<Vec<Arc<CudaEvent>>> {
        let p = &self.plan;
        if s + 1 >= p.members() {
            return Ok(Vec::new());
        }
        let Dims { b, hkv, d, .. } = p.dims;
        let bytes = |blk: usize| b * p.rows[blk] * hkv * d * self.elem;
        let (now, next) = (bytes(p.block_at(s)), bytes(p.block_at(s + 1)));
        let [rk, rv] = self.layout.recv[s + 1];
        let dt = self.glue.dt;
        let mut ev = ring.shift(p.peers, dt, (held.0, now), (self.base + rk as u64, next))?;
        ev.extend(ring.shift(p.peers, dt, (held.1, now), (self.base + rv as u64, next))?);
        Ok(ev)
    }

    /// Where the block of step `s + 1` arrives.
    fn received(&self, s: usize) -> (u64, u64) {
        let [rk, rv] = self.layout.recv[s + 1];
        (self.base + rk as u64, self.base + rv as u64)
    }

    /// The held block's K and V as the fused kernels read them beside the queries: as held,
    /// or with each head repeated into scratch.
    fn kv_beside_q(&self, blk: usize, held: (u64, u64)) -> Result<(u64, u64)> {
        let Some([rk, rv]) = self.layout.repeated else {
            return Ok(held);
        };
        let p = &self.plan;
        let Dims { b, hkv, d, .. } = p.dims;
        let rows = p.rows[blk];
        let (k, v) = (self.base + rk as u64, self.base + rv as u64);
        let sizes = [b, rows, rows, 0, hkv, p.ratio(), d];
        self.glue.gather((held.0, k), sizes)?;
        self.glue.gather((held.1, v), sizes)?;
        Ok((k, v))
    }

    /// The fused attention call of `rows` query rows against as many keys.
    fn shape(&self, rows: usize, causal: bool) -> AttentionShape {
        let Dims { b, h, d, .. } = self.plan.dims;
        AttentionShape {
            batch: b,
            heads: h,
            seq: rows,
            head_dim: d,
            causal,
            scale: self.plan.scale,
            dtype: self.dtype,
        }
    }
}

pub(super) fn forward(
    op: &CpAttention,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([q, k, v], [o, lse], [scratch]) = (io.inputs, &*io.outputs, &*io.scratch) else {
        return Err(device_error(
            name,
            "expects q, k, v, 2 outputs and 1 scratch buffer",
        ));
    };
    let c = call(op, b, q, (k, v), scratch)?;
    let Dims { b: nb, t, h, d, .. } = c.plan.dims;
    expect(name, "o", o, &[nb, t, h, d], q.dtype())?;
    expect(name, "lse", lse, &[nb, h, t], DType::F32)?;
    if nb * h == 0 {
        return Ok(());
    }
    let (g, base, elem) = (&c.glue, c.base, c.elem);
    let (acc, part, part_lse) = (
        base + c.layout.acc as u64,
        base + c.layout.part as u64,
        base + c.layout.part_lse as u64,
    );
    g.fill(lse.ptr(), f32::NEG_INFINITY, nb * h * t)?;
    g.fill(acc, 0.0, nb * t * h * d)?;
    let mut ring = Ring::new(g.rt, name);
    let mut held = (k.ptr(), v.ptr());
    for s in 0..c.plan.members() {
        let blk = c.plan.block_at(s);
        let mut arrival = c.pass_on_kv(&mut ring, s, held)?;
        let pairs = c.plan.pairs(blk);
        if !pairs.is_empty() {
            let rows = c.plan.rows[blk];
            let (kb, vb) = c.kv_beside_q(blk, held)?;
            for (qr, kr, causal) in pairs {
                let a = AttentionForward {
                    shape: c.shape(qr.len, causal),
                    q: rows_view(q.ptr(), elem, t, h, d, qr.at),
                    k: rows_view(kb, elem, rows, h, d, kr.at),
                    v: rows_view(vb, elem, rows, h, d, kr.at),
                    o: Bhtd::bthd(part, qr.len, h, d),
                    lse: part_lse,
                };
                attention_forward(g.rt, &a)?;
                g.merge(
                    (part, part_lse),
                    (acc, lse.ptr()),
                    [nb, qr.len, t, qr.at, h, d],
                )?;
            }
        }
        if s + 1 < c.plan.members() {
            ring.wait(&mut arrival)?;
            held = c.received(s);
        }
    }
    g.store(acc, o, nb * t * h * d)
}

pub(super) fn backward(
    op: &CpAttention,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([q, k, v, o, d_o, lse], [dq, dk, dv], [scratch]) = (io.inputs, &*io.outputs, &*io.scratch)
    else {
        return Err(device_error(
            name,
            "expects q, k, v, o, dO, lse, 3 outputs and 1 scratch buffer",
        ));
    };
    let c = call(op, b, q, (k, v), scratch)?;
    let Dims {
        b: nb,
        t,
        h,
        hkv,
        d,
        ..
    } = c.plan.dims;
    let dt = q.dtype();
    for (what, x) in [("o", *o), ("dO", *d_o), ("dq", dq)] {
        expect(name, what, x, &[nb, t, h, d], dt)?;
    }
    for (what, x) in [("dk", dk), ("dv", dv)] {
        expect(name, what, x, &[nb, t, hkv, d], dt)?;
    }
    expect(name, "lse", lse, &[nb, h, t], DType::F32)?;
    if nb * h == 0 {
        return Ok(());
    }
    let Some(grads) = &c.layout.grads else {
        return Err(device_error(name, "planned without gradient scratch"));
    };
    let (g, base, elem, n) = (&c.glue, c.base, c.elem, c.plan.members());
    let at = |off: usize| base + off as u64;
    let (dq_acc, dq_part, lse_rows) = (at(c.layout.acc), at(c.layout.part), at(c.layout.part_lse));
    let (dk_part, dv_part) = (at(grads.dk), at(grads.dv));
    let block = |blk: usize| nb * c.plan.rows[blk] * hkv * d;
    g.fill(dq_acc, 0.0, nb * t * h * d)?;
    let [k0, v0] = grads.acc[0];
    g.fill(at(k0), 0.0, block(c.plan.block_at(0)))?;
    g.fill(at(v0), 0.0, block(c.plan.block_at(0)))?;
    let mut ring = Ring::new(g.rt, name);
    let mut held = (k.ptr(), v.ptr());
    // The arrival of the dK/dV accumulators of the block held at the current step.
    let mut grads_in: Vec<Arc<CudaEvent>> = Vec::new();
    for s in 0..n {
        let blk = c.plan.block_at(s);
        let rows = c.plan.rows[blk];
        let [ak, av] = grads.acc[s];
        let mut arrival = c.pass_on_kv(&mut ring, s, held)?;
        let pairs = c.plan.pairs(blk);
        if !pairs.is_empty() {
            let (kb, vb) = c.kv_beside_q(blk, held)?;
            for (qr, kr, causal) in pairs {
                g.lse_rows((lse.ptr(), lse_rows), [nb * h, qr.len, t, qr.at])?;
                let a = AttentionBackward {
                    shape: c.shape(qr.len, causal),
                    q: rows_view(q.ptr(), elem, t, h, d, qr.at),
                    k: rows_view(kb, elem, rows, h, d, kr.at),
                    v: rows_view(vb, elem, rows, h, d, kr.at),
                    o: rows_view(o.ptr(), elem, t, h, d, qr.at),
                    d_o: rows_view(d_o.ptr(), elem, t, h, d, qr.at),
                    lse: lse_rows,
                    dq: Bhtd::bthd(dq_part, qr.len, h, d),
                    dk: Bhtd::bthd(dk_part, kr.len, h, d),
                    dv: Bhtd::bthd(dv_part, kr.len, h, d),
                    deterministic: false,
                };
                attention_backward(g.rt, &a)?;
                g.add_groups((dq_part, dq_acc), [nb, qr.len, t, qr.at, h, 1, d])?;
                ring.wait(&mut grads_in)?;
                let sizes = [nb, kr.len, rows, kr.at, hkv, c.plan.ratio(), d];
                g.add_groups((dk_part, at(ak)), sizes)?;
                g.add_groups((dv_part, at(av)), sizes)?;
            }
        }
        if n > 1 {
            // The block's accumulators move on with it; the last step brings the own block's
            // home.
            ring.wait(&mut grads_in)?;
            let [nk, nv] = grads.acc[s + 1];
            let (now, next) = (block(blk) * 4, block(c.plan.block_at(s + 1)) * 4);
            grads_in = ring.shift(c.plan.peers, DType::F32, (at(ak), now), (at(nk), next))?;
            grads_in.extend(ring.shift(c.plan.peers, DType::F32, (at(av), now), (at(nv), next))?);
        }
        if s + 1 < n {
            ring.wait(&mut arrival)?;
            held = c.received(s);
        }
    }
    ring.wait(&mut grads_in)?;
    let [hk, hv] = grads.acc[if n > 1 { n } else { 0 }];
    g.store(dq_acc, dq, nb * t * h * d)?;
    g.store(at(hk), dk, nb * t * hkv * d)?;
    g.store(at(hv), dv, nb * t * hkv * d)
}
