//! Decoding with a key/value cache: `KvCache` keeps each block's keys and values (`KvSlot`, on
//! the block's layout: heads split over the tensor-parallel axis as the projections split
//! them, the batch over the data-parallel one), and `Gpt::decode` runs the next positions of
//! a batch of sequences through the stages, extending the cache, to the logits of the last
//! position. A prompt is decoded whole (causal attention over it), then one token at a time
//! (its query over every key kept), so each step projects only the new token.
//!
//! `FixedKvCache` holds the same keys and values in tensors of a fixed number of positions
//! (made from a filled `KvCache`), and `Gpt::decode_at` runs one position whose index is a
//! device value over it: its shapes and ops are the same at every step, so a compiled step
//! captures it once and replays it (as one device graph on CUDA) for every token. Each step's
//! keys and values are written into the cache afterwards (`FixedKvCache::push`), in the
//! tensors' own memory where nothing else holds them.
//!
//! On a context-parallel axis the prompt decodes as training runs it (its sequence split over
//! the axis in the load-balanced order, attention by `context_attention`), and the fixed cache
//! splits its positions over the axis in equal blocks: each rank keeps its share of a long
//! context's keys and values, a step attends over each block where it lies
//! (`decode_attention_blocks`), and each new position's key and value land on the rank whose
//! block holds it.

use oxiflow_ops::context_parallel::SeqOrder;
use oxiflow_ops::decode::{rows_beside, write_rows_in_place};
use oxiflow_sbp::{NdSbp, Sbp, Shape};

use crate::shape_error::shape_err;
use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::attention::KvSlot;
use super::block::BlockMlp;
use super::config::GptLayout;
use super::fused_gate_up::FusedGateUp;
use super::fused_qkv::FusedQkv;
use super::model::Gpt;
use crate::nn::Pass;

/// The keys and values of every block for the positions decoded so far.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    slots: Vec<KvSlot>,
}

impl KvCache {
    /// Positions decoded so far.
    pub fn len(&self) -> usize {
        self.slots.first().map_or(0, |s| s.len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Every block's keys and values in tensors `[B, P, G, D]` of a fixed number P of positions,
/// the first `len` of them written (see the module docs). On a context-parallel axis P splits
/// over its ranks in equal blocks (rounded up to a multiple of them; decoding fills at most
/// the positions asked for).
#[derive(Clone, Debug)]
pub struct FixedKvCache {
    /// Each block's keys and values.
    pub kv: Vec<(Tensor, Tensor)>,
    len: usize,
    /// The positions decoding may fill (at most the tensors' P).
    limit: usize,
}

impl FixedKvCache {
    /// Positions written so far.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Positions decoding may fill (those asked of [`Gpt::fix_cache`]).
    pub fn positions(&self) -> usize {
        self.limit
    }

    /// Writes each block's key and value `[B, 1, G, D]` of one decoding step (`rows`, in block
    /// order) at the next position: in the tensors' own memory where nothing else holds them
    /// (one write per placement), else into new tensors put in their place; returns whether
    /// every write was in place.
    pub fn push(&mut self, rows: &[(Tensor, Tensor)]) -> Result<bool> {
        if rows.len() != self.kv.len() || self.len >= self.positions() {
            return Err(TensorError::Shape {
                op: "FixedKvCache::push",
                shapes: format!("{} blocks' rows", rows.len()),
                sbps: String::new(),
                detail: format!(
                    "a cache of {} blocks with {} of {} positions written",
                    self.kv.len(),
                    self.len,
                    self.positions()
                ),
            });
        }
        let mut all: Vec<Tensor> = std::mem::take(&mut self.kv)
            .into_iter()
            .flat_map(|(k, v)| [k, v])
            .collect();
        let new: Vec<&Tensor> = rows.iter().flat_map(|(k, v)| [k, v]).collect();
        // One write per run of caches on one placement (a pipeline stage's blocks).
        let mut written = Ok(true);
        let mut start = 0;
        while start < all.len() {
            let end = (start..all.len())
                .find(|&i| all[i].placement() != all[start].placement())
                .unwrap_or(all.len());
            written = write_rows_in_place(&mut all[start..end], &new[start..end], 1, self.len)
                .and_then(|w| Ok(w && written?));
            if written.is_err() {
                break;
            }
            start = end;
        }
        let mut back = all.into_iter();
        while let (Some(k), Some(v)) = (back.next(), back.next()) {
            self.kv.push((k, v));
        }
        let in_place = written?;
        self.len += 1;
        Ok(in_place)
    }
}

/// The first `len` token positions of `x` `[B, T, ..]`, whose sequence lies in `order`, in
/// position order (whole on the mesh axes that split the sequence: the rows a cache write
/// takes).
fn in_position_order(x: &Tensor, order: SeqOrder, len: usize) -> Result<Tensor> {
    let t = x.shape().dim(1);
    if order == SeqOrder::Natural {
        return if len == t {
            Ok(x.clone())
        } else {
            x.narrow(1, 0, len)
        };
    }
    let index = order
        .indices(t)
        .get(..len)
        .map(|i| i.iter().map(|&i| i as i64).collect::<Vec<_>>())
        .ok_or_else(|| shape_err("Gpt::fix_cache", x, format!("{len} positions held of {t}")))?;
    let index = Tensor::from_vec(index, [len])?;
    match x.placement() {
        Some(p) => {
            let index = index.to_global(p, NdSbp::broadcast(p.ndim()))?;
            rows_beside(x, x, 1)?.index_select(1, &index)
        }
        None => x.index_select(1, &index),
    }
}

/// What a decoding step reads beside the model's parameters: each block's fused
/// query/key/value projection ([`FusedQkv`]) and fused gate/up ([`FusedGateUp`]) where it has
/// them. Made once by [`Gpt::decode_weights`] and written again in place by later calls, so a
/// captured step that takes its tensors as inputs reads them where they are.
#[derive(Clone, Debug, Default)]
pub struct DecodeWeights {
    qkv: Vec<Option<FusedQkv>>,
    gate_up: Vec<Option<FusedGateUp>>,
}

impl DecodeWeights {
    /// Every tensor: the fused projections' in block order (the weight, then the bias where
    /// there is one), then the fused gates/ups' in block order.
    pub fn tensors(&self) -> Vec<Tensor> {
        let qkv = self
            .qkv
            .iter()
            .flatten()
            .flat_map(|f| std::iter::once(f.weight.clone()).chain(f.bias.clone()));
        let gate_up = self.gate_up.iter().flatten().map(|f| f.weight.clone());
        qkv.chain(gate_up).collect()
    }

    /// How many blocks run their query/key/value projections as one product, and how many
    /// their gate and up.
    pub fn fused_blocks(&self) -> (usize, usize) {
        (
            self.qkv.iter().flatten().count(),
            self.gate_up.iter().flatten().count(),
        )
    }

    /// The same structure over `tensors` (as [`DecodeWeights::tensors`] lists them: a step's
    /// inputs).
    pub fn with_tensors(&self, tensors: &[Tensor]) -> Result<DecodeWeights> {
        let err = || weights_err(tensors.len(), self.tensors().len());
        let mut it = tensors.iter().cloned();
        let mut qkv = Vec::with_capacity(self.qkv.len());
        for f in &self.qkv {
            qkv.push(match f {
                None => None,
                Some(f) => {
                    let weight = it.next().ok_or_else(err)?;
                    let bias = match f.bias {
                        Some(_) => Some(it.next().ok_or_else(err)?),
                        None => None,
                    };
                    Some(f.with(weight, bias))
                }
            });
        }
        let mut gate_up = Vec::with_capacity(self.gate_up.len());
        for f in &self.gate_up {
            gate_up.push(match f {
                None => None,
                Some(_) => Some(FusedGateUp {
                    weight: it.next().ok_or_else(err)?,
                }),
            });
        }
        if it.next().is_some() {
            return Err(err());
        }
        Ok(DecodeWeights { qkv, gate_up })
    }
}

fn weights_err(got: usize, want: usize) -> TensorError {
    TensorError::Shape {
        op: "DecodeWeights::with_tensors",
        shapes: format!("{got} tensors"),
        sbps: String::new(),
        detail: format!("the decoding weights hold {want}"),
    }
}

impl Gpt {
    /// The decoding weights of this model's current parameters: `kept` (made by an earlier
    /// call for this model) written again in place where nothing else holds its memory, else
    /// new ones. Every rank calls it alike.
    pub fn decode_weights(&self, kept: Option<DecodeWeights>) -> Result<DecodeWeights> {
        let _ng = oxiflow_tensor::no_grad();
        let n = self.blocks.len();
        if let Some(mut w) = kept.filter(|w| w.qkv.len() == n && w.gate_up.len() == n) {
            for ((q, g), block) in w.qkv.iter_mut().zip(&mut w.gate_up).zip(&self.blocks) {
                if let Some(q) = q {
                    block.attn.refresh_fused_qkv(q)?;
                }
                if let (Some(g), BlockMlp::Dense(mlp)) = (g, &block.mlp) {
                    mlp.refresh_fused_gate_up(g)?;
                }
            }
            return Ok(w);
        }
        let mut w = DecodeWeights::default();
        for block in &self.blocks {
            w.qkv.push(block.attn.fused_qkv()?);
            w.gate_up.push(match &block.mlp {
                BlockMlp::Dense(mlp) => mlp.fused_gate_up()?,
                BlockMlp::Moe(_) => None,
            });
        }
        Ok(w)
    }

    /// The keys and values `cache` holds in a [`FixedKvCache`] of `positions` positions (at
    /// least those held, at most the model's). On a context-parallel axis the prompt's keys
    /// and values (split in its token order) move into position order, the positions split
    /// over the axis's ranks in equal blocks.
    pub fn fix_cache(&self, cache: &KvCache, positions: usize) -> Result<FixedKvCache> {
        let len = cache.len();
        if positions < len || positions > self.cfg.seq_len {
            return Err(TensorError::Shape {
                op: "Gpt::fix_cache",
                shapes: String::new(),
                sbps: String::new(),
                detail: format!(
                    "{positions} positions for {len} held and a model of {}",
                    self.cfg.seq_len
                ),
            });
        }
        let order = self.layout.seq_order();
        let room = match order {
            SeqOrder::Natural => positions,
            SeqOrder::Balanced { ranks } => positions.div_ceil(ranks) * ranks,
        };
        let mut kv = Vec::with_capacity(cache.slots.len());
        for slot in &cache.slots {
            let Some((k, v)) = &slot.kv else {
                return Err(TensorError::Shape {
                    op: "Gpt::fix_cache",
                    shapes: String::new(),
                    sbps: String::new(),
                    detail: "a block's cache is empty: decode the prompt first".into(),
                });
            };
            // Zeros of `room` positions laid out as the held keys or values.
            let zeros = |t: &Tensor| -> Result<Tensor> {
                let shape = t.shape().with_dim(1, room);
                match (t.placement(), t.nd_sbp()) {
                    (Some(p), Some(nd)) => Tensor::zeros_global(shape, t.dtype(), p, nd.clone()),
                    _ => Ok(Tensor::zeros(shape, t.dtype())),
                }
            };
            let mut pair = [zeros(k)?, zeros(v)?];
            let held = [
                in_position_order(k, order, len)?,
                in_position_order(v, order, len)?,
            ];
            write_rows_in_place(&mut pair, &[&held[0], &held[1]], 1, 0)?;
            let [k, v] = pair;
            kv.push((k, v));
        }
        Ok(FixedKvCache {
            kv,
            len,
            limit: positions,
        })
    }

    /// ids `[B, 1]` (i64, split over the data-parallel axis, on the first stage) at the device
    /// position `pos` (one i64, broadcast on the first stage; the position `cache` writes next)
    /// -> the logits `[B, table_rows]` (on the last stage) and every block's key and value of
    /// the position, for [`FixedKvCache::push`]. Reads nothing on the host: one compiled step
    /// serves every position.
    pub fn decode_at(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        cache: &[(Tensor, Tensor)],
        weights: &DecodeWeights,
    ) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        if cache.len() != self.blocks.len() || ids.shape().dims().get(1) != Some(&1) {
            return Err(shape_err(
                "Gpt::decode_at",
                ids,
                format!(
                    "needs ids [B, 1] and a cache of {} blocks, got {}",
                    self.blocks.len(),
                    cache.len()
                ),
            ));
        }
        let wte = self.wte.weight.compute()?;
        let tok = Tensor::embedding(ids, &wte)?;
        let x = match &self.wpe {
            Some(wpe) => {
                let at = Tensor::embedding(&pos.reshape([1, 1])?, &wpe.weight.compute()?)?;
                tok.add(&at)?
            }
            None => tok,
        };
        let x = self.layout.relayout(&x, self.stream())?;
        let mut rows = Vec::with_capacity(self.blocks.len());
        let x = self.through_blocks(x, Some(pos.clone()), |i, x, layout, stream, pos| {
            let pos = pos.ok_or_else(|| TensorError::Shape {
                op: "Gpt::decode_at",
                shapes: String::new(),
                sbps: String::new(),
                detail: "the position did not travel with the stream".into(),
            })?;
            let (y, k, v) = self.blocks[i].forward_at(
                x,
                &self.cfg,
                layout,
                stream,
                (&cache[i].0, &cache[i].1),
                pos,
                (
                    weights.qkv.get(i).and_then(Option::as_ref),
                    weights.gate_up.get(i).and_then(Option::as_ref),
                ),
            )?;
            rows.push((k, v));
            Ok(y)
        })?;
        let logits = self.logits_at(&x, wte, 0)?;
        Ok((logits, rows))
    }

    /// An empty cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            slots: vec![KvSlot::default(); self.blocks.len()],
        }
    }

    /// ids `[B, T]` (i64; global ids split over the data-parallel axis, on the first stage) at
    /// the positions after those `cache` holds -> the logits `[B, table_rows]` of their last
    /// position (on the last stage), the cache extended by them. An empty cache takes any T
    /// the positions allow; a filled one, T = 1 (not on a context-parallel axis: see
    /// [`Gpt::fix_cache`]).
    pub fn decode(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let t = ids.shape().dims().get(1).copied().unwrap_or(0);
        self.decode_prompt(ids, t, cache)
    }

    /// [`Gpt::decode`] of ids `[B, T]` whose first `len` tokens are the prompt and the rest
    /// pad it (causal attention keeps them out of the prompt's results): the logits of
    /// position `len - 1`, the cache holding `len` positions. Padding lets a prompt on a
    /// context-parallel axis cut into equal chunks (which CUDA's fused attention needs); it
    /// takes an empty cache.
    pub fn decode_prompt(&self, ids: &Tensor, len: usize, cache: &mut KvCache) -> Result<Tensor> {
        let t = ids.shape().dims().get(1).copied().unwrap_or(0);
        if len == 0 || len > t || (len < t && !cache.is_empty()) {
            return Err(shape_err(
                "Gpt::decode_prompt",
                ids,
                format!(
                    "{len} of the ids' {t} positions are the prompt (at least 1; fewer only \
                     into an empty cache, which holds {})",
                    cache.len()
                ),
            ));
        }
        if cache.slots.len() != self.blocks.len() {
            return Err(shape_err(
                "Gpt::decode",
                ids,
                format!(
                    "a cache of {} blocks for a model of {}",
                    cache.slots.len(),
                    self.blocks.len()
                ),
            ));
        }
        let wte = self.wte.weight.compute()?;
        let x = self.embed_at(ids, &wte, Pass::Eval, cache.len())?;
        let x = self.through_blocks(x, None, |i, x, layout, stream, _| {
            self.blocks[i].forward_cached(x, &self.cfg, layout, stream, &mut cache.slots[i])
        })?;
        let order = self.layout.seq_order();
        if len < t {
            for slot in &mut cache.slots {
                // The padding's keys and values leave a cache in position order now; one in
                // the context-parallel order keeps them until `fix_cache` picks the prompt's.
                if let (Some((k, v)), SeqOrder::Natural) = (&slot.kv, order) {
                    slot.kv = Some((k.narrow(1, 0, len)?, v.narrow(1, 0, len)?));
                }
                slot.len = len;
            }
        }
        self.logits_at(&x, wte, order.indices(t)[len - 1])
    }

    /// The residual stream `x` (on the first stage) through every block in stage order, each
    /// as `block(i, x, layout, stream, along)` runs it, moved from stage to stage, and `along`
    /// (a position) moved with it, broadcast on each stage.
    fn through_blocks(
        &self,
        mut x: Tensor,
        mut along: Option<Tensor>,
        mut block: impl FnMut(usize, &Tensor, &GptLayout, Sbp, Option<&Tensor>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let stream = self.stream();
        for g in 0..self.split.chunks() {
            let layout = self.split.chunk_layout(g);
            if g > 0 && self.split.stage_of(g) != self.split.stage_of(g - 1) {
                if let Some((p, nd)) = self.stream_layout(g) {
                    x = x.to_global(&p, nd)?;
                }
                if let (Some(a), Some(p)) = (&along, layout.placement()) {
                    along = Some(a.to_global(p, NdSbp::broadcast(p.ndim()))?);
                }
            }
            for i in self.split.blocks(g) {
                x = block(i, &x, layout, stream, along.as_ref())?;
            }
        }
        Ok(x)
    }

    /// The logits `[B, table_rows]` (on the last stage) of row `index` along T of the blocks'
    /// output `x` `[B, T, C]`, through the head table (`wte`, the token table's compute value,
    /// where it is tied).
    fn logits_at(&self, x: &Tensor, wte: Tensor, index: usize) -> Result<Tensor> {
        let table = match &self.lm_head {
            Some(h) => h.weight.compute()?,
            None => self.to_last_stage(wte)?,
        };
        let h = self.head_input(x)?;
        let (b, c) = (h.shape().dim(0), h.shape().dim(2));
        let last = h.narrow(1, index, 1)?.reshape(Shape::new([b, c]))?;
        last.matmul_t_at(&table, (false, true), self.matmul_precision())
    }
}
