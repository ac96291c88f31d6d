//! Causal self-attention, Megatron style on a mesh: Q, K and V column-parallel (each rank
//! holds whole heads), the output projection row-parallel. Grouped-query attention: K and V
//! have fewer heads, each shared by a group of query heads, which the fused attention op
//! takes as they are; under tensor parallelism they split over the axis when there are enough
//! of them to divide evenly, else every rank computes all of them and attention repeats each
//! the fewest times that make them split into whole groups beside the queries' heads.
//! Rotary positions rotate Q and K per head. On a context-parallel axis the sequence is
//! split in the load-balanced causal order and attention runs as `context_attention` (ring or
//! all-to-all), K and V keeping their own heads (GQA inside the op).

use crate::shape_error::shape_err;
use crate::{Result, TensorError};
use oxiflow_ops::attention::flash_attention_at;
use oxiflow_ops::context_parallel::{context_attention, CpAlgorithm, CpAttrs, SeqOrder};
use oxiflow_ops::decode::{decode_attention, decode_attention_blocks, rows_beside};
use oxiflow_tensor::{F64Bits, MatmulPrecision, Tensor};

use super::super::linear::{Linear, Parallel};
use super::super::param::{Module, Parameter};
use super::arch::Arch;
use super::config::{GptConfig, GptLayout};
use super::fused_qkv::{FusedQkv, Projections};
use super::rope::Rope;

/// Causal scaled-dot-product attention on the heads layout of the projections: q
/// `[B, T, H, D]`, k and v `[B, T, G, D]` (H a multiple of G: query head `h` reads key/value
/// head `h / (H / G)`) -> `[B, T, H, D]`, softmax(q k^T / sqrt(D) + mask) v, by the fused
/// `flash_attention` op (no `[T, T]` probabilities kept: the backward recomputes them from the
/// saved log-sum-exp). Batch and heads may be split; the softmax runs over each rank's own
/// heads. f32 products run at `precision` on a device.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    precision: MatmulPrecision,
) -> Result<Tensor> {
    let (qd, kd) = (q.shape().dims(), k.shape().dims());
    let fits = qd.len() == 4
        && kd.len() == 4
        && (kd[0], kd[1], kd[3]) == (qd[0], qd[1], qd[3])
        && v.shape() == k.shape();
    if !fits {
        return Err(TensorError::Shape {
            op: "causal_attention",
            shapes: format!("{}, {}, {}", q.shape(), k.shape(), v.shape()),
            sbps: format!("{:?}, {:?}, {:?}", q.nd_sbp(), k.nd_sbp(), v.nd_sbp()),
            detail: "q must be [B, T, H, D], k and v [B, T, G, D] of one shape".into(),
        });
    }
    let d = q.shape().dim(3);
    flash_attention_at(q, k, v, (true, 1.0 / (d.max(1) as f64).sqrt()), precision)
}

/// `x` `[B, T, G, D]` with each of its G heads repeated `group` times in place (head `j` of the
/// result is head `j / group` of `x`), laid out like `like`: the key/value heads a group of
/// query heads shares. The backward sums each head's copies.
pub fn repeat_heads(x: &Tensor, group: usize, like: &Tensor) -> Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let &[b, t, g, d] = x.shape().dims() else {
        return Err(shape_err("repeat_heads", x, "needs [B, T, G, D]".into()));
    };
    let one = x.reshape([b, t, g, 1, d])?;
    let copies = vec![&one; group];
    Tensor::concat(&copies, 3)?
        .reshape([b, t, g * group, d])?
        .to_layout_of(like)
}

/// The keys and values one block keeps while decoding: `[B, S, G, D]` each on the block's
/// layout as the fused attention takes them beside the queries (heads split over the
/// tensor-parallel axis as the projections split them, repeated where those do not divide
/// over it), for the `len` positions decoded so far.
#[derive(Clone, Debug, Default)]
pub struct KvSlot {
    pub kv: Option<(Tensor, Tensor)>,
    pub len: usize,
}

/// Q, K, V projections `name.{q,k,v}` (`[C, H D]`, `[C, G D]`, `[C, G D]` for H query and G
/// key/value heads of width D) and the output projection `name.proj` `[H D, C]`.
#[derive(Clone, Debug)]
pub struct CausalSelfAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub proj: Linear,
    heads: usize,
    kv_heads: usize,
    rope: Option<Rope>,
    /// The token order along the sequence (load-balanced on a context-parallel axis).
    order: SeqOrder,
    /// How attention runs over a context-parallel split.
    cp_algorithm: CpAlgorithm,
    /// Whether K and V are repeated to the query heads before a context-parallel attention
    /// (their heads are not split over the tensor-parallel axis while the queries' are).
    cp_repeat_kv: bool,
    /// How many times the fused attention repeats each key/value head: 1 where they split over
    /// the tensor-parallel axis as the queries' heads do (or there is none), else the fewest
    /// copies whose count the axis divides (every rank then holds whole groups).
    kv_repeat: usize,
}

impl CausalSelfAttention {
    /// GPT-2's attention (`Arch::gpt2`).
    pub fn new(name: &str, cfg: &GptConfig, layout: &GptLayout) -> Result<CausalSelfAttention> {
        CausalSelfAttention::with_arch(name, cfg, &Arch::gpt2(), layout)
    }

    /// The attention of `arch`.
    pub fn with_arch(
        name: &str,
        cfg: &GptConfig,
        arch: &Arch,
        layout: &GptLayout,
    ) -> Result<CausalSelfAttention> {
        let (c, hd, kv) = (cfg.width, cfg.head_dim(), arch.kv(cfg));
        let tp = layout.tp();
        let column = layout.linear_biased(cfg, layout.column(), arch.qkv_bias);
        let kv_parallel = if arch.kv_split(cfg, tp) {
            layout.column()
        } else {
            Parallel::Replicated
        };
        let kv_opts = layout.linear_biased(cfg, kv_parallel, arch.qkv_bias);
        let row = layout.linear_biased(cfg, layout.row(), arch.out_bias);
        let (q_out, kv_out) = (cfg.heads * hd, kv * hd);
        let cp = layout.cp();
        let cp_repeat_kv = tp > 1 && !arch.kv_split(cfg, tp);
        if cp > 1 && cfg.context_attention == CpAlgorithm::AllToAll {
            let kv_heads = if cp_repeat_kv { cfg.heads } else { kv };
            let ways = tp * cp;
            if !cfg.heads.is_multiple_of(ways) || !kv_heads.is_multiple_of(ways) {
                return Err(TensorError::Shape {
                    op: "CausalSelfAttention",
                    shapes: format!("{} heads, {kv_heads} kv heads", cfg.heads),
                    sbps: "-".into(),
                    detail: format!(
                        "alltoall context attention splits heads over tp {tp} x cp {cp} = {ways} \
                         ranks: the heads and kv heads must both be divisible by {ways}"
                    ),
                });
            }
        }
        Ok(CausalSelfAttention {
            q: Linear::new(&format!("{name}.q"), c, q_out, &column)?,
            k: Linear::new(&format!("{name}.k"), c, kv_out, &kv_opts)?,
            v: Linear::new(&format!("{name}.v"), c, kv_out, &kv_opts)?,
            proj: Linear::new(&format!("{name}.proj"), q_out, c, &row)?,
            heads: cfg.heads,
            kv_heads: kv,
            rope: Rope::new(arch, hd)
                .map(|r| {
                    r.with_tables(
                        cfg.seq_len,
                        cfg.dtype,
                        layout.placement(),
                        layout.seq_order(),
                    )
                })
                .transpose()?,
            order: layout.seq_order(),
            cp_algorithm: cfg.context_attention,
            cp_repeat_kv,
            kv_repeat: if tp > 1 && !arch.kv_split(cfg, tp) {
                tp / gcd(kv, tp)
            } else {
                1
            },
        })
    }

    /// The query heads and key/value heads.
    pub fn heads(&self) -> (usize, usize) {
        (self.heads, self.kv_heads)
    }

    /// x `[B, T, C]` (whole on the tensor-parallel axis) -> the attended values `[B, T, H D]`
    /// before the output projection, heads merged (split on the tensor-parallel axis).
    pub fn attend(&self, x: &Tensor) -> Result<Tensor> {
        let (q, k, v) = self.project(x, 0)?;
        if self.order != SeqOrder::Natural {
            return self.attend_split(&q, &k, &v);
        }
        let (b, t) = (x.shape().dim(0), x.shape().dim(1));
        let (k, v) = self.kv_beside(&k, &v, &q)?;
        let width = q.shape().dim(2) * q.shape().dim(3);
        let mp = self.q.weight.matmul_precision();
        causal_attention(&q, &k, &v, mp)?.reshape([b, t, width])
    }

    /// Causal attention of q, k, v `[B, T, .., D]` whose sequence lies in the context-parallel
    /// order, as `context_attention` runs it (K and V repeated to the query heads where their
    /// heads do not split as the queries' do) -> `[B, T, H D]`.
    fn attend_split(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let group = if self.cp_repeat_kv {
            self.heads / self.kv_heads.max(1)
        } else {
            1
        };
        let (k, v) = (repeat_heads(k, group, q)?, repeat_heads(v, group, q)?);
        let (b, t) = (q.shape().dim(0), q.shape().dim(1));
        let (width, d) = (q.shape().dim(2) * q.shape().dim(3), q.shape().dim(3));
        let attrs = CpAttrs {
            causal: true,
            scale: F64Bits::new(1.0 / (d.max(1) as f64).sqrt()),
            order: self.order,
        };
        context_attention(q, &k, &v, attrs, self.cp_algorithm)?.reshape([b, t, width])
    }

    /// k and v `[B, T, G, D]` as the fused attention takes them beside q: as they are where
    /// their heads split as q's do, else each head repeated `kv_repeat` times and laid out as
    /// q (a split of whole groups).
    fn kv_beside(&self, k: &Tensor, v: &Tensor, q: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            repeat_heads(k, self.kv_repeat, q)?,
            repeat_heads(v, self.kv_repeat, q)?,
        ))
    }

    /// The attended values of x `[B, T, C]` (as [`CausalSelfAttention::attend`]) for positions
    /// after those whose keys and values `slot` holds, which it extends by x's: the first call
    /// (an empty slot) attends causally over x, a later one takes one position (T = 1) and
    /// attends over every key kept. On a context-parallel axis the first call runs as
    /// `attend` does (x's sequence split in its order, and so the slot's); later positions
    /// decode over a [`FixedKvCache`](super::FixedKvCache) made from it
    /// ([`CausalSelfAttention::attend_at`]).
    pub fn attend_cached(&self, x: &Tensor, slot: &mut KvSlot) -> Result<Tensor> {
        let (b, t) = (x.shape().dim(0), x.shape().dim(1));
        let pos0 = slot.len;
        if self.order != SeqOrder::Natural {
            if pos0 > 0 {
                return Err(shape_err(
                    "CausalSelfAttention::attend_cached",
                    x,
                    format!(
                        "on a context-parallel axis a cache of {pos0} positions is extended \
                         through a fixed cache (Gpt::fix_cache, then Gpt::decode_at)"
                    ),
                ));
            }
            let (q, k, v) = self.project(x, 0)?;
            let o = self.attend_split(&q, &k, &v)?;
            slot.kv = Some(self.kv_beside(&k, &v, &q)?);
            slot.len = t;
            return Ok(o);
        }
        if pos0 > 0 && t != 1 {
            return Err(shape_err(
                "CausalSelfAttention::attend_cached",
                x,
                format!("after {pos0} cached positions, one position at a time"),
            ));
        }
        let (q, k, v) = self.project(x, pos0)?;
        let (k, v) = self.kv_beside(&k, &v, &q)?;
        let (k, v) = match slot.kv.take() {
            Some((ck, cv)) => (
                Tensor::concat(&[&ck, &k], 1)?,
                Tensor::concat(&[&cv, &v], 1)?,
            ),
            None => (k, v),
        };
        slot.kv = Some((k.clone(), v.clone()));
        slot.len += t;
        let width = q.shape().dim(2) * q.shape().dim(3);
        let mp = self.q.weight.matmul_precision();
        let o = if pos0 == 0 {
            causal_attention(&q, &k, &v, mp)?
        } else {
            flash_attention_at(&q, &k, &v, (false, self.scale(&q)), mp)?
        };
        o.reshape([b, t, width])
    }

    /// The attended values of one position x `[B, 1, C]` at the device position `pos` (one
    /// i64, broadcast on the block's placement) over the keys and values `cache` holds at the
    /// positions before it (`[B, P, G, D]` each, laid out as [`KvSlot`] keeps them), and the
    /// position's own key and value `[B, 1, G, D]`, which the caller writes into the cache at
    /// `pos` afterwards: nothing here reads `pos` on the host, so one captured program serves
    /// every step. With `fused` (made by [`CausalSelfAttention::fused_qkv`]) q, k and v come
    /// from one product, split and rotated by one op. On a context-parallel axis the caches'
    /// positions split over its ranks in equal blocks (as [`Gpt::fix_cache`] lays them out),
    /// each attended to where it lies and the blocks merged (`decode_attention_blocks`); the
    /// position's key and value come back whole on that axis.
    ///
    /// [`Gpt::fix_cache`]: super::Gpt::fix_cache
    pub fn attend_at(
        &self,
        x: &Tensor,
        cache: (&Tensor, &Tensor),
        pos: &Tensor,
        fused: Option<&FusedQkv>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t) = (x.shape().dim(0), x.shape().dim(1));
        if t != 1 {
            return Err(shape_err(
                "CausalSelfAttention::attend_at",
                x,
                "decodes one position at a time".into(),
            ));
        }
        let (q, k, v) = match (fused, self.fusable_qkv()) {
            (Some(f), Some(rope)) => {
                f.project_at(x, rope, pos, self.q.weight.matmul_precision())?
            }
            _ => self.project_with(x, |r, y| r.apply_at(y, pos))?,
        };
        let (k, v) = self.kv_beside(&k, &v, &q)?;
        let width = q.shape().dim(2) * q.shape().dim(3);
        let o = match self.order {
            SeqOrder::Natural => decode_attention(&q, cache, (&k, &v), pos, self.scale(&q))?,
            SeqOrder::Balanced { ranks } => {
                // The caches' positions split over the context-parallel ranks in `ranks`
                // blocks: each attends over its own, the new position's query, key and value
                // whole beside them.
                let whole = |y: &Tensor| rows_beside(y, cache.0, 1);
                let (q, k, v) = (whole(&q)?, whole(&k)?, whole(&v)?);
                let o = decode_attention_blocks(&q, cache, (&k, &v), pos, self.scale(&q), ranks)?;
                return Ok((o.reshape([b, t, width])?, k, v));
            }
        };
        Ok((o.reshape([b, t, width])?, k, v))
    }

    /// The rotary positions where decoding may run q, k and v as one product ([`FusedQkv`]):
    /// rotary positions in natural order, the key/value heads laid out as the queries' (no
    /// repeats), whole groups of query heads, no adapters, and biases on all three or none.
    pub(super) fn fusable_qkv(&self) -> Option<&Rope> {
        let plain = [&self.q, &self.k, &self.v]
            .iter()
            .all(|l| l.lora.is_none() && l.bias.is_some() == self.q.bias.is_some());
        let grouped = self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads);
        let fits = plain && grouped && self.kv_repeat == 1 && self.order == SeqOrder::Natural;
        self.rope.as_ref().filter(|_| fits)
    }

    /// Its q, k and v projections as one for decoding, or None where they do not fuse (see
    /// [`CausalSelfAttention::fusable_qkv`]).
    pub fn fused_qkv(&self) -> Result<Option<FusedQkv>> {
        match self.fusable_qkv() {
            Some(_) => FusedQkv::new(self.projections()).map(Some),
            None => Ok(None),
        }
    }

    /// Writes the projections' current values into `fused` (made by
    /// [`CausalSelfAttention::fused_qkv`]), in place where it may.
    pub fn refresh_fused_qkv(&self, fused: &mut FusedQkv) -> Result<()> {
        fused.refresh(self.projections())
    }

    fn projections(&self) -> Projections<'_> {
        Projections {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            heads: (self.heads, self.kv_heads),
        }
    }

    /// The scores' scale 1 / sqrt(D) for q `[B, T, H, D]`.
    fn scale(&self, q: &Tensor) -> f64 {
        1.0 / (q.shape().dim(3).max(1) as f64).sqrt()
    }

    /// The queries `[B, T, H, D]`, keys and values `[B, T, G, D]` of x `[B, T, C]` at
    /// positions `pos0..pos0 + T` (rotated where the positions are rotary).
    pub fn project(&self, x: &Tensor, pos0: usize) -> Result<(Tensor, Tensor, Tensor)> {
        self.project_with(x, |r, y| r.apply_in(y, pos0, self.order))
    }

    /// [`CausalSelfAttention::project`] with Q and K rotated by `rotate` (with rotary positions).
    fn project_with(
        &self,
        x: &Tensor,
        rotate: impl Fn(&Rope, &Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t) = (x.shape().dim(0), x.shape().dim(1));
        let heads = |y: Tensor, h: usize| {
            let d = y.shape().dim(2) / h.max(1);
            y.reshape([b, t, h, d])
        };
        let q = heads(self.q.forward(x)?, self.heads)?;
        let k = heads(self.k.forward(x)?, self.kv_heads)?;
        let v = heads(self.v.forward(x)?, self.kv_heads)?;
        match &self.rope {
            Some(r) => Ok((rotate(r, &q)?, rotate(r, &k)?, v)),
            None => Ok((q, k, v)),
        }
    }
}

/// The greatest common divisor of `a` and `b` (`b` when `a` is 0).
fn gcd(a: usize, b: usize) -> usize {
    if a == 0 {
        b
    } else {
        gcd(b % a, a)
    }
}

impl Module for CausalSelfAttention {
    fn parameters(&self) -> Vec<Parameter> {
        [&self.q, &self.k, &self.v, &self.proj]
            .iter()
            .flat_map(|l| l.parameters())
            .collect()
    }
}
