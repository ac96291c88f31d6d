//! Attention over a sequence split across ranks (context parallelism): q `[B, T, H, D]`, k
//! `[B, T, Hkv, D]`, v `[B, T, Hkv, Dv]` (any GQA ratio `H / Hkv`) give `o [B, T, H, Dv]` and the
//! log-sum-exp `lse [B, H, T]` of each row's masked, scaled scores, with tokens along T in a
//! [`SeqOrder`] (causal masks compare token positions, not indices).
//!
//! Layouts, per mesh axis: split on batch, on heads (q, k, v and o `S(2)`, lse `S(1)`), on the
//! sequence (q, k, v and o `S(1)`, lse `S(2)`), or broadcast; the backward also takes a partial
//! dO. On the sequence split the kernel runs a ring over the ranks of that mesh axis (its
//! [`Peers`](oxiflow_tensor::Peers), the one addition this op needs from the public contract):
//! K/V blocks move member to member, each sent while the block in hand is attended to, and the
//! partial outputs merge by online softmax; the backward ring carries dK/dV with their block and
//! brings them home. [`context_attention`] with [`CpAlgorithm::AllToAll`] (Ulysses) instead
//! boxes q, k, v from the sequence split to the heads split (an all-to-all), attends locally and
//! boxes o back. CPU kernels in f32, f64, bf16 and f16 (computed in f64; 16-bit data keeps its
//! softmax statistics in f32); CUDA kernels in f32, bf16 and f16 (the fused attention per pair
//! of token runs, the ring over NCCL: see `cuda`); other backends and dtypes are
//! `TensorError::NoKernel` on every rank before anything runs.

mod cpu;
mod cuda;
mod cuda_glue;
mod cuda_plan;
mod cuda_ring;
mod order;

use std::sync::LazyLock;

use crate::attention::AttentionRules;
use crate::operand_dtypes::cpu_and_cuda_scratch;
use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, NdSbp, RuleMode, Sbp, Shape};
use oxiflow_tensor::{
    dispatch_multi, Extern, ExternOp, F64Bits, Grad, Inferred, Kernels, LocalAt, MetaError,
    MetaResult, Peers, Result, Saves, Tensor, TensorError,
};

pub use order::SeqOrder;

/// How attention runs on a sequence split over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpAlgorithm {
    /// K/V blocks passed around the ranks of the splitting axis.
    Ring,
    /// Heads <-> sequence all-to-all before and after a local attention (heads, and kv heads,
    /// divisible by the ranks that split the sequence).
    AllToAll,
}

impl CpAlgorithm {
    /// The algorithm's flag value (`ring`, `alltoall`).
    pub fn name(self) -> &'static str {
        match self {
            CpAlgorithm::Ring => "ring",
            CpAlgorithm::AllToAll => "alltoall",
        }
    }
}

/// The attributes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpAttrs {
    /// Keys at later token positions than the query's are masked.
    pub causal: bool,
    /// Scores are `scale q . k`.
    pub scale: F64Bits,
    /// The order of the tokens along T.
    pub order: SeqOrder,
}

/// Which pass of the op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// (q, k, v) -> (o, lse).
    Forward,
    /// (q, k, v, o, dO, lse) -> (dq, dk, dv).
    Backward,
}

/// Where one rank's call sits: the whole sequence length, the ring over the sequence split, and
/// the GQA ratio of its local heads (an error when its pieces do not fit a ring or a head split).
#[derive(Clone, Debug)]
pub(crate) struct RankAt {
    pub seq_len: usize,
    pub peers: std::result::Result<Peers, String>,
}

/// Attention over a split sequence, one pass (see the module docs).
#[derive(Clone, Debug)]
pub struct CpAttention {
    pub attrs: CpAttrs,
    pub pass: Pass,
    at: Option<RankAt>,
}

impl CpAttention {
    /// The global op of `pass`.
    pub fn new(attrs: CpAttrs, pass: Pass) -> CpAttention {
        CpAttention {
            attrs,
            pass,
            at: None,
        }
    }
}

/// The input dtypes of the CPU kernels (16-bit data with f32 statistics).
const CPU_DTYPES: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16];

/// The input dtypes of the CUDA kernels (16-bit data and f32 with f32 statistics).
const CUDA_DTYPES: &[DType] = &[DType::F32, DType::BF16, DType::F16];

static FORWARD: LazyLock<Kernels> = LazyLock::new(|| {
    cpu_and_cuda_scratch::<CpAttention>(
        (CPU_DTYPES, cpu::forward),
        (CUDA_DTYPES, cuda::forward, cuda::scratch),
    )
});
static BACKWARD: LazyLock<Kernels> = LazyLock::new(|| {
    cpu_and_cuda_scratch::<CpAttention>(
        (CPU_DTYPES, cpu::backward),
        (CUDA_DTYPES, cuda::backward, cuda::scratch),
    )
});

/// The sizes of one call: q `[b, t, h, d]`, k `[b, t, hkv, d]`, v `[b, t, hkv, dv]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    pub dv: usize,
}

impl Dims {
    fn o(&self) -> [usize; 4] {
        [self.b, self.t, self.h, self.dv]
    }
    fn lse(&self) -> [usize; 3] {
        [self.b, self.h, self.t]
    }
}

fn shape_err(detail: String) -> MetaError {
    MetaError::Shape(detail)
}

/// Checks q, k, v and the scale; returns the sizes.
pub(crate) fn check_qkv(
    q: &[usize],
    k: &[usize],
    v: &[usize],
) -> std::result::Result<Dims, String> {
    let (&[b, t, h, d], &[kb, kt, hkv, kd], &[vb, vt, vh, dv]) = (q, k, v) else {
        return Err(format!(
            "q [B, T, H, D], k [B, T, Hkv, D] and v [B, T, Hkv, Dv] must be 4-d, got q {q:?}, k {k:?}, v {v:?}"
        ));
    };
    if (kb, kt, kd) != (b, t, d) || (vb, vt, vh) != (b, t, hkv) {
        return Err(format!(
            "k must be [B, T, Hkv, D] and v [B, T, Hkv, Dv] for q [B, T, H, D], got q {q:?}, k {k:?}, v {v:?}"
        ));
    }
    if hkv == 0 || h % hkv != 0 {
        return Err(format!(
            "the heads of q ({h}) must be a positive multiple of the kv heads ({hkv})"
        ));
    }
    if d == 0 || dv == 0 {
        return Err(format!(
            "head sizes must be positive, got q {q:?} and v {v:?}"
        ));
    }
    Ok(Dims {
        b,
        t,
        h,
        hkv,
        d,
        dv,
    })
}

/// One rank's call as every backend's kernels take it: its sizes, its ring, and the token
/// position of every row of each member's block (in member order).
pub(crate) struct RankCall<'a> {
    pub dims: Dims,
    pub peers: &'a Peers,
    pub block_pos: Vec<Vec<usize>>,
}

impl CpAttention {
    /// This rank's call on local q, k, v of these shapes, or why its pieces do not fit a ring.
    pub(crate) fn rank_call(
        &self,
        q: &[usize],
        k: &[usize],
        v: &[usize],
    ) -> std::result::Result<RankCall<'_>, String> {
        let at = self
            .at
            .as_ref()
            .ok_or("runs only through dispatch, which gives it its ranks")?;
        let peers = at.peers.as_ref().map_err(Clone::clone)?;
        let dims = check_qkv(q, k, v)?;
        let mine = &peers.regions()[peers.me()];
        if mine.len() != dims.t || mine.end > at.seq_len {
            return Err(format!(
                "this rank's {} rows do not fit its sequence range {mine:?} of {}",
                dims.t, at.seq_len
            ));
        }
        let positions = self.attrs.order.positions(at.seq_len);
        let block_pos = peers
            .regions()
            .iter()
            .map(|r| positions.get(r.clone()).map(<[usize]>::to_vec))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| format!("ranges {:?} of {}", peers.regions(), at.seq_len))?;
        Ok(RankCall {
            dims,
            peers,
            block_pos,
        })
    }
}

impl ExternOp for CpAttention {
    fn name(&self) -> &'static str {
        match self.pass {
            Pass::Forward => "context_attention",
            Pass::Backward => "context_attention_backward",
        }
    }

    fn attrs(&self, key: &mut Vec<u8>) {
        key.push(u8::from(self.pass == Pass::Backward));
        key.push(u8::from(self.attrs.causal));
        key.extend_from_slice(&self.attrs.scale.get().to_bits().to_le_bytes());
        self.attrs.order.key(key);
    }

    fn arity(&self) -> (usize, usize) {
        match self.pass {
            Pass::Forward => (3, 3),
            Pass::Backward => (6, 6),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = d[0];
        if !dt.is_float() || d[..d.len().min(5)].iter().any(|&x| x != dt) {
            return Err(MetaError::DType(format!(
                "q, k, v (and o, dO) must share one float dtype, got {d:?}"
            )));
        }
        if !self.attrs.scale.get().is_finite() {
            return Err(shape_err(format!(
                "scale must be finite, got {}",
                self.attrs.scale.get()
            )));
        }
        let dims = check_qkv(s[0].dims(), s[1].dims(), s[2].dims()).map_err(shape_err)?;
        let attention = AttentionRules {
            layouts: &rules::SEQUENCE_LAYOUTS,
            o: dims.o(),
            lse: dims.lse(),
            dtype: dt,
            stats: dt.compute(),
        };
        match self.pass {
            Pass::Forward => Ok(attention.forward(mode)),
            Pass::Backward => attention.backward(s, d, mode),
        }
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Extern> {
        let seq_len = at.global_inputs[0].dims().get(1).copied().unwrap_or(0);
        let peers = at.peers_along(0, 1).and_then(|p| {
            // k and v must be split on the sequence exactly as q.
            for i in [1, 2] {
                let other = at.peers_along(i, 1)?;
                if other.regions() != p.regions() {
                    return Err(format!(
                        "input {i} holds sequence ranges {:?}, q {:?}",
                        other.regions(),
                        p.regions()
                    ));
                }
            }
            // A heads split must keep each query head with its kv head.
            let (h, hkv) = (
                at.global_inputs[0].dims().get(2).copied().unwrap_or(0),
                at.global_inputs[1].dims().get(2).copied().unwrap_or(1),
            );
            let ratio = h / hkv.max(1);
            let head = |i: usize| {
                at.input_regions
                    .get(i)
                    .and_then(|r| r.get(2))
                    .cloned()
                    .unwrap_or(0..if i == 0 { h } else { hkv })
            };
            let (qh, kh) = (head(0), head(1));
            if qh.start != kh.start * ratio || qh.len() != kh.len() * ratio {
                return Err(format!(
                    "this rank holds query heads {qh:?} and kv heads {kh:?}: a heads split must \
                     keep the {ratio} query heads of each kv head together (split heads and kv \
                     heads by a divisor of both)"
                ));
            }
            Ok(p)
        });
        Some(Extern::new(CpAttention {
            attrs: self.attrs,
            pass: self.pass,
            at: Some(RankAt { seq_len, peers }),
        }))
    }

    fn kernels(&self) -> &Kernels {
        match self.pass {
            Pass::Forward => &FORWARD,
            Pass::Backward => &BACKWARD,
        }
    }

    fn differentiable(&self, output: usize) -> bool {
        // The log-sum-exp is a statistic for the backward; the gradients have none of their own.
        self.pass == Pass::Forward && output == 0
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self.pass {
            Pass::Forward => Saves::inputs(&[0, 1, 2]).and_outputs(&[0, 1]),
            Pass::Backward => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        if self.pass == Pass::Backward {
            return Err(Grad::unsupported(
                self.name(),
                "the attention backward has no gradient of its own (no double backward)",
            ));
        }
        let Some(Some(d_o)) = g.dys().first() else {
            return Ok(vec![None, None, None]);
        };
        let (q, k, v) = (g.input(0)?, g.input(1)?, g.input(2)?);
        let (o, lse) = (g.output(0)?, g.output(1)?);
        let op = Extern::new(CpAttention::new(self.attrs, Pass::Backward));
        let grads = dispatch_multi(op.into(), &[q, k, v, o, d_o, lse])?;
        Ok(grads
            .into_iter()
            .enumerate()
            .map(|(i, t)| g.need(i).then_some(t))
            .collect())
    }
}

fn err(detail: String) -> TensorError {
    TensorError::Shape {
        op: "context_attention",
        shapes: String::new(),
        sbps: String::new(),
        detail,
    }
}

/// Attention over q `[B, T, H, D]`, k `[B, T, Hkv, D]`, v `[B, T, Hkv, Dv]` whose tokens lie
/// along T in `attrs.order`: `o [B, T, H, Dv]` and `lse [B, H, T]`. Global operands split on T
/// run `algorithm` over the ranks of the splitting mesh axis: the ring as they lie, the
/// all-to-all by boxing to a heads split and o back to q's layout (refused, before any
/// communication, unless the heads and kv heads divide over the ranks that would split them).
pub fn context_attention_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attrs: CpAttrs,
    algorithm: CpAlgorithm,
) -> Result<(Tensor, Tensor)> {
    let run = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<(Tensor, Tensor)> {
        let op = Extern::new(CpAttention::new(attrs, Pass::Forward));
        let mut outs = dispatch_multi(op.into(), &[q, k, v])?.into_iter();
        match (outs.next(), outs.next()) {
            (Some(o), Some(lse)) => Ok((o, lse)),
            _ => Err(TensorError::Kernel {
                op: "context_attention",
                detail: "the op gave fewer than 2 outputs".into(),
            }),
        }
    };
    let (Some(placement), Some(nd)) = (q.placement(), q.nd_sbp()) else {
        return run(q, k, v);
    };
    if algorithm == CpAlgorithm::Ring || !nd.iter().any(|s| s == Sbp::S(1)) {
        return run(q, k, v);
    }
    let heads_nd = NdSbp::new(
        nd.iter()
            .map(|s| if s == Sbp::S(1) { Sbp::S(2) } else { s })
            .collect::<Vec<_>>(),
    );
    let ways: usize = heads_nd
        .iter()
        .zip(placement.shape())
        .filter(|(s, _)| *s == Sbp::S(2))
        .map(|(_, &n)| n)
        .product();
    let head_count = |x: &Tensor| x.shape().dims().get(2).copied().unwrap_or(0);
    let (h, hkv) = (head_count(q), head_count(k));
    if h % ways != 0 || hkv % ways != 0 {
        return Err(err(format!(
            "alltoall attention splits heads over {ways} ranks ({heads_nd} on {placement}): \
             the {h} heads and {hkv} kv heads must both be divisible by {ways}"
        )));
    }
    let box_to = |x: &Tensor| x.to_global(placement, heads_nd.clone());
    let (o, lse) = run(&box_to(q)?, &box_to(k)?, &box_to(v)?)?;
    Ok((o.to_global(placement, nd.clone())?, lse))
}

/// [`context_attention_lse`]'s output alone.
pub fn context_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attrs: CpAttrs,
    algorithm: CpAlgorithm,
) -> Result<Tensor> {
    Ok(context_attention_lse(q, k, v, attrs, algorithm)?.0)
}
