//! Decoding with a key/value cache: `KvCache` keeps each block's keys and values (`KvSlot`, on
//! the block's layout: heads split over the tensor-parallel axis as the projections split
//! them, the batch over the data-parallel one), and `Gpt::decode` runs the next positions of
//! a batch of sequences through the stages, extending the cache, to the logits of the last
//! position. A prompt is decoded whole (causal attention over it), then one token at a time
//! (its query over every key kept), so each step projects only the new token.

use oxiflow_sbp::Shape;

use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::attention::KvSlot;
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

impl Gpt {
    /// An empty cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            slots: vec![KvSlot::default(); self.blocks.len()],
        }
    }

    /// ids `[B, T]` (i64; global ids split over the data-parallel axis, on the first stage) at
    /// the positions after those `cache` holds -> the logits `[B, table_rows]` of their last
    /// position (on the last stage), the cache extended by them. An empty cache takes any T
    /// the positions allow; a filled one, T = 1.
    pub fn decode(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        if cache.slots.len() != self.blocks.len() {
            return Err(TensorError::Shape {
                op: "Gpt::decode",
                shapes: ids.shape().to_string(),
                sbps: format!("{:?}", ids.nd_sbp()),
                detail: format!(
                    "a cache of {} blocks for a model of {}",
                    cache.slots.len(),
                    self.blocks.len()
                ),
            });
        }
        let wte = self.wte.weight.compute()?;
        let mut x = self.embed_at(ids, &wte, Pass::Eval, cache.len())?;
        let stream = self.stream();
        for g in 0..self.split.chunks() {
            if g > 0 && self.split.stage_of(g) != self.split.stage_of(g - 1) {
                if let Some((p, nd)) = self.stream_layout(g) {
                    x = x.to_global(&p, nd)?;
                }
            }
            let layout = self.split.chunk_layout(g);
            for i in self.split.blocks(g) {
                x = self.blocks[i].forward_cached(
                    &x,
                    &self.cfg,
                    layout,
                    stream,
                    &mut cache.slots[i],
                )?;
            }
        }
        let table = match &self.lm_head {
            Some(h) => h.weight.compute()?,
            None => self.to_last_stage(wte)?,
        };
        let h = self.head_input(&x)?;
        let (b, t, c) = (h.shape().dim(0), h.shape().dim(1), h.shape().dim(2));
        let last = h.narrow(1, t - 1, 1)?.reshape(Shape::new([b, c]))?;
        last.matmul_t_at(&table, (false, true), self.matmul_precision())
    }
}
