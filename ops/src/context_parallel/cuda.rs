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
//! their group. Every buffer is scratch the executor allocates from the op's declaration.
//!
//! The fused kernels take one length for queries and keys, so the runs are cut into pieces of
//! one length (the largest dividing them all); a sequence that would need more than
//! [`MAX_RUNS`] pieces (lengths that do not split evenly) is refused by every rank before
//! anything moves, as are value heads of another width than key heads.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaEvent, PushKernelArg};
use oxiflow_collectives::{DeviceFence, DevicePtr};
use oxiflow_cuda::kernel_layer::{
    attention_backward, attention_forward, grid, AttentionBackward, AttentionForward,
    AttentionShape, Bhtd, FloatType,
};
use oxiflow_cuda::{
    device_error, launched, CudaKernels, CudaRuntime, CudaSource, CudaStorage, KernelIds,
};
use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use oxiflow_tensor::{ExternOp, KernelIo, OutSpec, Peers, Result};

use super::{block_positions, check_qkv, CpAttention, Dims, Pass};

/// The kernels of `cp.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CpKernel {
    /// Rows of a block with each head repeated.
    Gather(DType),
    /// A partial output into the accumulator.
    Merge(DType),
    /// Per-query-head gradients summed into their group's f32 accumulator.
    AddGroups(DType),
    /// An f32 accumulator into an output.
    Store(DType),
    /// A partial log-sum-exp into the running one.
    MergeLse,
    /// Rows of the log-sum-exps, made contiguous.
    LseRows,
    /// An f32 buffer set to one value.
    Fill,
}

impl KernelIds for CpKernel {
    const ALL: &'static [Self] = &[
        CpKernel::Gather(DType::F32),
        CpKernel::Gather(DType::BF16),
        CpKernel::Gather(DType::F16),
        CpKernel::Merge(DType::F32),
        CpKernel::Merge(DType::BF16),
        CpKernel::Merge(DType::F16),
        CpKernel::AddGroups(DType::F32),
        CpKernel::AddGroups(DType::BF16),
        CpKernel::AddGroups(DType::F16),
        CpKernel::Store(DType::F32),
        CpKernel::Store(DType::BF16),
        CpKernel::Store(DType::F16),
        CpKernel::MergeLse,
        CpKernel::LseRows,
        CpKernel::Fill,
    ];
    fn entry(self) -> &'static str {
        match self {
            CpKernel::Gather(DType::BF16) => "cp_gather_rows_bf16",
            CpKernel::Gather(DType::F16) => "cp_gather_rows_f16",
            CpKernel::Gather(_) => "cp_gather_rows_f32",
            CpKernel::Merge(DType::BF16) => "cp_merge_bf16",
            CpKernel::Merge(DType::F16) => "cp_merge_f16",
            CpKernel::Merge(_) => "cp_merge_f32",
            CpKernel::AddGroups(DType::BF16) => "cp_add_groups_bf16",
            CpKernel::AddGroups(DType::F16) => "cp_add_groups_f16",
            CpKernel::AddGroups(_) => "cp_add_groups_f32",
            CpKernel::Store(DType::BF16) => "cp_store_bf16",
            CpKernel::Store(DType::F16) => "cp_store_f16",
            CpKernel::Store(_) => "cp_store_f32",
            CpKernel::MergeLse => "cp_merge_lse",
            CpKernel::LseRows => "cp_lse_rows",
            CpKernel::Fill => "cp_fill",
        }
    }
}

static SOURCE: CudaSource<CpKernel> = CudaSource::new("context_parallel", include_str!("cp.cu"));

/// Consecutive token positions `pos .. pos + len` held at rows `at .. at + len` of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    at: usize,
    pos: usize,
    len: usize,
}

/// The maximal runs of consecutive positions in `pos`.
fn runs_of(pos: &[usize]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for (i, &p) in pos.iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.pos + r.len == p => r.len += 1,
            _ => out.push(Run {
                at: i,
                pos: p,
                len: 1,
            }),
        }
    }
    out
}

/// The most runs a call cuts its sequence into.
const MAX_RUNS: usize = 64;

/// Each block's runs of consecutive positions, cut into pieces of one length (the largest that
/// divides every run), so any two meet as a square block; None beyond [`MAX_RUNS`] pieces.
fn equal_runs(positions: &[Vec<usize>]) -> Option<Vec<Vec<Run>>> {
    let runs: Vec<Vec<Run>> = positions.iter().map(|p| runs_of(p)).collect();
    let gcd = |a: usize, b: usize| {
        let (mut a, mut b) = (a, b);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let len = runs.iter().flatten().fold(0, |g, r| gcd(g, r.len));
    let total: usize = runs.iter().flatten().map(|r| r.len / len.max(1)).sum();
    if total > MAX_RUNS {
        return None;
    }
    Some(
        runs.iter()
            .map(|rs| {
                rs.iter()
                    .flat_map(|r| {
                        (0..r.len / len).map(move |i| Run {
                            at: r.at + i * len,
                            pos: r.pos + i * len,
                            len,
                        })
                    })
                    .collect()
            })
            .collect(),
    )
}

/// How query run `q` attends to key run `k`: `None` when the mask hides every key, else whether
/// the call is causal (the run with itself). Runs of a permutation's positions are equal or
/// disjoint; anything else is an error.
fn pairing(causal: bool, q: Run, k: Run) -> std::result::Result<Option<bool>, String> {
    if !causal {
        Ok(Some(false))
    } else if (k.pos, k.len) == (q.pos, q.len) {
        Ok(Some(true))
    } else if k.pos + k.len <= q.pos {
        Ok(Some(false))
    } else if k.pos >= q.pos + q.len {
        Ok(None)
    } else {
        Err(format!(
            "query positions {}..{} and key positions {}..{} overlap in part",
            q.pos,
            q.pos + q.len,
            k.pos,
            k.pos + k.len
        ))
    }
}

/// One rank's call: sizes, the ring and each member's runs.
struct Plan<'a> {
    dims: Dims,
    peers: &'a Peers,
    runs: Vec<Vec<Run>>,
    rows: Vec<usize>,
    causal: bool,
    scale: f32,
}

impl<'a> Plan<'a> {
    /// The plan of `op` on local q, k, v of these shapes; the same checks on every member.
    fn new(
        op: &'a CpAttention,
        q: &[usize],
        k: &[usize],
        v: &[usize],
    ) -> std::result::Result<Plan<'a>, String> {
        let at = op
            .at
            .as_ref()
            .ok_or("runs only through dispatch, which gives it its ranks")?;
        let peers = at.peers.as_ref().map_err(Clone::clone)?;
        let dims = check_qkv(q, k, v)?;
        if dims.d != dims.dv || dims.d > 256 {
            return Err(format!(
                "the fused attention on CUDA takes value heads as wide as key heads, at most 256 \
                 wide: got {} and {}",
                dims.d, dims.dv
            ));
        }
        let mine = &peers.regions()[peers.me()];
        if mine.len() != dims.t || mine.end > at.seq_len {
            return Err(format!(
                "this rank's {} rows do not fit its sequence range {mine:?} of {}",
                dims.t, at.seq_len
            ));
        }
        let positions = block_positions(op.attrs.order, at.seq_len, peers)?;
        let runs = equal_runs(&positions).ok_or_else(|| {
            format!(
                "the fused attention on CUDA takes blocks of equal length, but {} tokens over \
                 {} ranks in {:?} order do not cut into at most {MAX_RUNS} equal runs: use a \
                 sequence length that splits evenly (a multiple of twice the ranks in the \
                 load-balanced order)",
                at.seq_len,
                peers.len(),
                op.attrs.order,
            )
        })?;
        let causal = op.attrs.causal;
        for qr in runs.iter().flatten() {
            for kr in runs.iter().flatten() {
                pairing(causal, *qr, *kr)?;
            }
        }
        Ok(Plan {
            dims,
            peers,
            rows: positions.iter().map(Vec::len).collect(),
            runs,
            causal,
            scale: op.attrs.scale.get() as f32,
        })
    }

    fn members(&self) -> usize {
        self.peers.len()
    }

    /// The block held at ring step `s` (step 0: this rank's own).
    fn block_at(&self, s: usize) -> usize {
        let n = self.members();
        (self.peers.me() + n - s % n) % n
    }

    /// This rank's query runs against block `blk`'s key runs that the mask leaves any key of,
    /// with whether each call is causal.
    fn pairs(&self, blk: usize) -> Vec<(Run, Run, bool)> {
        let mine = &self.runs[self.peers.me()];
        mine.iter()
            .flat_map(|&q| self.runs[blk].iter().map(move |&k| (q, k)))
            .filter_map(|(q, k)| match pairing(self.causal, q, k) {
                Ok(Some(causal)) => Some((q, k, causal)),
                _ => None,
            })
            .collect()
    }

    fn max_run(&self) -> usize {
        self.runs.iter().flatten().map(|r| r.len).max().unwrap_or(0)
    }

    fn ratio(&self) -> usize {
        self.dims.h / self.dims.hkv.max(1)
    }
}

/// Byte offsets into the one scratch buffer, each 256-byte aligned.
#[derive(Default)]
struct Carve {
    end: usize,
}

impl Carve {
    fn take(&mut self, bytes: usize) -> usize {
        let at = self.end;
        self.end = (at + bytes).next_multiple_of(256);
        at
    }
}

/// The scratch of a call: received K/V blocks per ring step (index 0, the rank's own, unused),
/// repeated heads, one pair's partial results, the f32 accumulator of o (forward) or dQ
/// (backward), and the backward's gradient scratch.
struct Layout {
    recv: Vec<[usize; 2]>,
    repeated: Option<[usize; 2]>,
    part: usize,
    part_lse: usize,
    acc: usize,
    grads: Option<GradLayout>,
    bytes: usize,
}

/// The backward's per-pair dK/dV and the f32 dK/dV accumulators that travel the ring: entry `s`
/// for the block held at step `s`, and entry `n` for the own block come home (one entry alone
/// without a ring).
struct GradLayout {
    dk: usize,
    dv: usize,
    acc: Vec<[usize; 2]>,
}

fn layout(p: &Plan<'_>, elem: usize, backward: bool) -> Layout {
    let Dims {
        b, t, h, hkv, d, ..
    } = p.dims;
    let mut c = Carve::default();
    let block = |rows: usize, e: usize| b * rows * hkv * d * e;
    let n = p.members();
    let recv = (0..n)
        .map(|s| match s {
            0 => [0, 0],
            _ => {
                let bytes = block(p.rows[p.block_at(s)], elem);
                [c.take(bytes), c.take(bytes)]
            }
        })
        .collect();
    let max_rows = p.rows.iter().copied().max().unwrap_or(0);
    let repeated = (p.ratio() > 1).then(|| {
        let bytes = b * max_rows * h * d * elem;
        [c.take(bytes), c.take(bytes)]
    });
    let run = p.max_run();
    let part = c.take(b * run * h * d * elem);
    let part_lse = c.take(b * h * run * 4);
    let acc = c.take(b * t * h * d * 4);
    let grads = backward.then(|| {
        let (dk, dv) = (
            c.take(b * run * h * d * elem),
            c.take(b * run * h * d * elem),
        );
        let steps = if n > 1 { n + 1 } else { 1 };
        let acc = (0..steps)
            .map(|s| {
                let bytes = block(p.rows[p.block_at(s)], 4);
                [c.take(bytes), c.take(bytes)]
            })
            .collect();
        GradLayout { dk, dv, acc }
    });
    Layout {
        recv,
        repeated,
        part,
        part_lse,
        acc,
        grads,
        bytes: c.end,
    }
}

/// The one scratch buffer of a call (a word when its plan fails: the kernel reports that).
pub(super) fn scratch(op: &CpAttention, ins: &[OutSpec], _outs: &[OutSpec]) -> Vec<OutSpec> {
    let bytes = match ins {
        [q, k, v, ..] => Plan::new(op, q.shape.dims(), k.shape.dims(), v.shape.dims())
            .map(|p| layout(&p, q.dtype.size(), op.pass == Pass::Backward).bytes)
            .unwrap_or(0),
        _ => 0,
    };
    vec![OutSpec {
        shape: Shape::new([bytes.div_ceil(8).max(1)]),
        dtype: DType::I64,
    }]
}

/// Rows `at ..` of a `[B, rows, heads, e]` buffer at `ptr` (elements of `elem` bytes) as a
/// `[B, heads, .., e]` view.
fn rows_view(ptr: u64, elem: usize, rows: usize, heads: usize, e: usize, at: usize) -> Bhtd {
    Bhtd::bthd(ptr + (at * heads * e * elem) as u64, rows, heads, e)
}

/// The launches of `cp.cu` for one call of element type `dt`.
struct Glue<'a> {
    rt: &'a Arc<CudaRuntime>,
    name: &'static str,
    dt: DType,
}

impl Glue<'_> {
    /// Launches `k` over `count` threads with pointer arguments `ptrs`, then `float` (when
    /// given), then the `ints` as i64.
    fn launch(
        &self,
        k: CpKernel,
        count: usize,
        ptrs: &[u64],
        float: Option<f32>,
        ints: &[usize],
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        // The kernels index in 32 bits, with room for the grid's stride.
        if count > (u32::MAX / 2) as usize {
            return Err(device_error(
                self.name,
                format!("{k:?} over {count} elements (at most 2^31)"),
            ));
        }
        let f = SOURCE.function(self.rt, self.name, k)?;
        let ints: Vec<i64> = ints.iter().map(|&x| x as i64).collect();
        let mut l = self.rt.launcher(self.name, f)?;
        for p in ptrs {
            l.arg(p);
        }
        if let Some(x) = &float {
            l.arg(x);
        }
        for x in &ints {
            l.arg(x);
        }
        // SAFETY: each `cp.cu` kernel takes its pointers, then (cp_fill) a float, then i64
        // sizes, in the order the callers below pass them; every pointer is a live input,
        // output or scratch region covering the elements those sizes index (the layouts above
        // and the shapes checked before any launch), held by the executor past the launch.
        launched(self.name, unsafe { l.launch(grid(count)) })
    }

    /// `dst [b, rows, g rep, e]` <- rows `row0 ..` of `src [b, src_t, g, e]`, heads repeated.
    fn gather(
        &self,
        (src, dst): (u64, u64),
        [b, rows, src_t, row0, g, rep, e]: [usize; 7],
    ) -> Result<()> {
        let n = b * rows * g * rep * e;
        let ints = [b, rows, src_t, row0, g, rep, e];
        self.launch(CpKernel::Gather(self.dt), n, &[src, dst], None, &ints)
    }

    /// Partial `(o, lse)` of `n` query rows into the accumulator `acc` `[b, t, h, e]` and the
    /// running log-sum-exps `lacc` at rows `row0 ..`.
    fn merge(
        &self,
        (o, lse): (u64, u64),
        (acc, lacc): (u64, u64),
        [b, n, t, row0, h, e]: [usize; 6],
    ) -> Result<()> {
        let ints = [b, n, t, row0, h, e];
        self.launch(
            CpKernel::Merge(self.dt),
            b * n * h * e,
            &[o, lse, acc, lacc],
            None,
            &ints,
        )?;
        let ints = [b * h, n, t, row0];
        self.launch(CpKernel::MergeLse, b * h * n, &[lse, lacc], None, &ints)
    }

    /// `dst` f32 `[b, dst_t, g, e]` at rows `row0 ..` += `src [b, rows, g rep, e]` summed over
    /// each head's copies.
    fn add_groups(
        &self,
        (src, dst): (u64, u64),
        [b, rows, dst_t, row0, g, rep, e]: [usize; 7],
    ) -> Result<()> {
        let ints = [b, rows, dst_t, row0, g, rep, e];
        self.launch(
            CpKernel::AddGroups(self.dt),
            b * rows * g * e,
            &[src, dst],
            None,
            &ints,
        )
    }

    /// `n` f32 values of `src` into `dst` of the call's type.
    fn store(&self, src: u64, dst: &CudaStorage, n: usize) -> Result<()> {
        self.launch(CpKernel::Store(self.dt), n, &[src, dst.ptr()], None, &[n])
    }

    /// `dst [bh, n]` <- rows `row0 ..` of `src [bh, t]` (f32).
    fn lse_rows(&self, (src, dst): (u64, u64), [bh, n, t, row0]: [usize; 4]) -> Result<()> {
        self.launch(
            CpKernel::LseRows,
            bh * n,
            &[src, dst],
            None,
            &[bh, n, t, row0],
        )
    }

    /// `n` f32 values at `p` set to `v`.
    fn fill(&self, p: u64, v: f32, n: usize) -> Result<()> {
        self.launch(CpKernel::Fill, n, &[p], Some(v), &[n])
    }
}

/// Where a ring exchange reports its end: the events the compute stream waits for before it
/// reads what arrived (or frees what was sent).
#[derive(Default)]
struct Arrival(Mutex<Vec<Arc<CudaEvent>>>);

impl DeviceFence for Arrival {
    fn after_collective(&self, done: &Arc<CudaEvent>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(done.clone());
    }
}

/// The exchanges a call has posted: the compute stream waits for every one before the call
/// returns (its scratch is freed on that stream), on every path out.
struct Ring<'a> {
    rt: &'a Arc<CudaRuntime>,
    name: &'static str,
    posted: Vec<Arc<CudaEvent>>,
}

impl Ring<'_> {
    /// Posts one ring step: `send` (address, bytes) to the next member, `recv` from the
    /// previous, elements of `dt`; returns the step's end events.
    fn shift(
        &mut self,
        peers: &Peers,
        dt: DType,
        send: (u64, usize),
        recv: (u64, usize),
    ) -> Result<Vec<Arc<CudaEvent>>> {
        let fence = Arrival::default();
        let dev = self.rt.ordinal();
        // SAFETY: both regions lie in buffers this call holds (its inputs or the executor's
        // scratch) until the compute stream has waited for the exchange's end, which `Ring`
        // makes it do before the call returns; nothing else writes the receiving region
        // meanwhile (each step receives into a region of its own).
        let (s, r) = unsafe {
            (
                DevicePtr::new(send.0, send.1, dev),
                DevicePtr::new(recv.0, recv.1, dev),
            )
        };
        let sent = peers.shift_device(self.name, dt, s.with_fence(&fence), r.with_fence(&fence));
        let events = std::mem::take(&mut *fence.0.lock().unwrap_or_else(PoisonError::into_inner));
        self.posted.extend(events.iter().cloned());
        sent?;
        Ok(events)
    }

    /// Makes the compute stream wait for `events` (drained).
    fn wait(&self, events: &mut Vec<Arc<CudaEvent>>) -> Result<()> {
        for e in events.drain(..) {
            self.rt
                .stream()
                .wait(&e)
                .map_err(|e| device_error(self.name, format!("waiting for the ring: {e}")))?;
        }
        Ok(())
    }
}

impl Drop for Ring<'_> {
    fn drop(&mut self) {
        let mut posted = std::mem::take(&mut self.posted);
        // An error has already been returned where this fails; the waits still order every
        // exchange that did start before the scratch is freed.
        let _ = self.wait(&mut posted);
    }
}

/// The fused kernels' element type of `dt`.
fn float_type(name: &'static str, dt: DType) -> Result<FloatType> {
    match dt {
        DType::F32 => Ok(FloatType::F32),
        DType::BF16 => Ok(FloatType::Bf16),
        DType::F16 => Ok(FloatType::F16),
        d => Err(device_error(name, format!("no CUDA kernel for {d}"))),
    }
}

/// A typed error unless `p` is `dtype` of `shape`.
fn expect(
    name: &'static str,
    what: &str,
    p: &CudaStorage,
    shape: &[usize],
    dtype: DType,
) -> Result<()> {
    if p.shape().dims() == shape && p.dtype() == dtype {
        return Ok(());
    }
    Err(device_error(
        name,
        format!(
            "{what} is {} {}, want {dtype} {shape:?}",
            p.dtype(),
            p.shape()
        ),
    ))
}

/// What both passes check and derive before anything runs.
struct Call<'a> {
    plan: Plan<'a>,
    layout: Layout,
    glue: Glue<'a>,
    shape: AttentionShape,
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
    let dtype = float_type(name, dt)?;
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
    let shape = AttentionShape {
        batch: plan.dims.b,
        heads: plan.dims.h,
        seq: 0,
        head_dim: plan.dims.d,
        causal: false,
        scale: plan.scale,
        dtype,
    };
    Ok(Call {
        plan,
        layout,
        glue: Glue {
            rt: b.runtime(),
            name,
            dt,
        },
        shape,
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

    fn shape(&self, rows: usize, causal: bool) -> AttentionShape {
        AttentionShape {
            seq: rows,
            causal,
            ..self.shape
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
    let mut ring = Ring {
        rt: g.rt,
        name,
        posted: Vec::new(),
    };
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
    let mut ring = Ring {
        rt: g.rt,
        name,
        posted: Vec::new(),
    };
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
