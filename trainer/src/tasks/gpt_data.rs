//! `GptData`: the GPT's batches: token windows (`Windows`: random over a corpus, or in order
//! over token shards from a resumable position), this rank's rows of each micro-batch made by
//! a background thread ahead of use and the next one turned into global tensors (uploaded to the
//! device) before it is asked for.

use std::sync::Arc;

use oxiflow_models::checkpoint::Metadata;
use oxiflow_models::data::{self, Prefetcher, StreamOrigin, Windows};
use oxiflow_models::nn::gpt::GptLayout;
use oxiflow_placement::{AxisRole, NamedMesh};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{no_grad, Tensor};

use crate::error::TrainError;
use crate::model::{Batch, BatchSource};

/// Held-out batches an evaluation averages.
pub const EVAL_BATCHES: u64 = 4;
/// Micro-batches made ahead by the background thread.
const PREFETCH_DEPTH: usize = 4;

/// How a batch's rows are split: `batch` rows over `dp` data-parallel ranks, this rank at
/// coordinate `coord`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSplit {
    pub batch: usize,
    pub dp: usize,
    pub coord: usize,
}

impl RowSplit {
    /// This rank's rows of micro-batch `index` of `count`.
    fn rows(&self, index: usize, count: usize) -> std::ops::Range<usize> {
        let per_part = self.batch / count;
        let per = per_part / self.dp;
        let at = index * per_part + self.coord * per;
        at..at + per
    }
}

/// The GPT's data on this rank.
pub struct GptData {
    train: Windows,
    heldout: Windows,
    split: RowSplit,
    /// The first stage's placement (inputs) and the last's (targets).
    first: NamedMesh,
    last: NamedMesh,
    description: String,
    /// Host rows of (step, part) keys `step * parts + part`, made ahead.
    prefetch: Option<(usize, Prefetcher<data::Batch>)>,
    /// The next key's tensors, made when the key before it was asked for.
    ready: Option<(u64, Batch)>,
}

impl GptData {
    /// Data from `(train, heldout)` windows, split as `split`, on the first and last stages'
    /// placements.
    pub fn new(
        (train, heldout): (Windows, Windows),
        split: RowSplit,
        (first, last): (NamedMesh, NamedMesh),
        description: String,
    ) -> GptData {
        GptData {
            train,
            heldout,
            split,
            first,
            last,
            description,
            prefetch: None,
            ready: None,
        }
    }

    /// Host rows as global `[rows, T]` ids on the first stage and targets on the last.
    fn to_tensors(&self, b: data::Batch) -> Result<Batch, TrainError> {
        let _ng = no_grad();
        let shape = [b.rows, b.seq_len];
        Ok(Batch {
            inputs: rows_on_stage(&self.first, b.inputs, shape)?,
            targets: rows_on_stage(&self.last, b.targets, shape)?,
        })
    }

    /// This rank's host rows of key `key` (of `parts` parts per step) from the background
    /// thread (restarted when `parts` changes).
    fn host_rows(&mut self, parts: usize, key: u64) -> Result<data::Batch, TrainError> {
        if self.prefetch.as_ref().map(|p| p.0) != Some(parts) {
            let (windows, split) = (self.train.clone(), self.split);
            let make = move |key: u64| {
                let (step, index) = (key / parts as u64, (key % parts as u64) as usize);
                windows.rows(step, split.rows(index, parts))
            };
            self.prefetch = Some((parts, Prefetcher::new(PREFETCH_DEPTH, make)));
            self.ready = None;
        }
        match self.prefetch.as_mut() {
            Some((_, p)) => Ok(p.get(key)?),
            None => Err(TrainError::Layout {
                detail: "the data prefetcher did not start".into(),
            }),
        }
    }
}

/// This rank's token rows `[rows, T]` (natural order) as global ids on a stage's mesh `m`:
/// the rows split over the data-parallel axis (and an expert-parallel one) and, on a context-parallel axis, the tokens in
/// the load-balanced order and split over it.
pub fn rows_on_stage(m: &NamedMesh, v: Vec<i64>, shape: [usize; 2]) -> Result<Tensor, TrainError> {
    let p = m.placement();
    let layout = GptLayout::Mesh(m.clone());
    let v = layout.seq_order().reorder_rows(&v, shape[1]);
    let mut whole = NdSbp::broadcast(p.ndim());
    for role in [AxisRole::Batch, AxisRole::Experts] {
        if let Some(axis) = m.axis(role) {
            whole.set(axis, Sbp::S(0));
        }
    }
    let nd = layout
        .activation_sbp(Sbp::B)
        .unwrap_or_else(|| whole.clone());
    Ok(Tensor::from_vec(v, shape)?
        .to_global(p, whole)?
        .to_global(p, nd)?)
}

impl BatchSource for GptData {
    fn batch_size(&self) -> usize {
        self.split.batch
    }
    fn tokens_per_row(&self) -> usize {
        match &self.train {
            Windows::Random { sampler, .. } => sampler.seq_len(),
            Windows::Sequential { windows, .. } => windows.seq_len(),
        }
    }
    fn train_batch(&mut self, step: u64, index: usize, count: usize) -> Result<Batch, TrainError> {
        let RowSplit { batch, dp, .. } = self.split;
        if count == 0 || !batch.is_multiple_of(count * dp) {
            return Err(TrainError::Layout {
                detail: format!(
                    "--batch-size {batch} is not a multiple of --dp {dp} x the {count} parts of a step"
                ),
            });
        }
        let key = step * count as u64 + index as u64;
        let now = match self.ready.take() {
            Some((k, b)) if k == key => b,
            _ => {
                let host = self.host_rows(count, key)?;
                self.to_tensors(host)?
            }
        };
        // The next part's tensors now, so its upload is queued ahead of its use.
        let next = self.host_rows(count, key + 1)?;
        self.ready = Some((key + 1, self.to_tensors(next)?));
        Ok(now)
    }
    fn heldout_batch(&mut self, i: u64) -> Result<Batch, TrainError> {
        let b = self.heldout.rows(i, self.split.rows(0, 1))?;
        self.to_tensors(b)
    }
    fn heldout_batches(&self) -> u64 {
        EVAL_BATCHES
    }
    fn position(&self, step: u64) -> Metadata {
        let mut m = Metadata::new();
        m.insert("data.step".into(), step.to_string());
        if let Ok(w) = self.train.windows_before(step) {
            m.insert("data.windows".into(), w.to_string());
        }
        m.insert("data.source".into(), self.description.clone());
        if let Some(p) = self.train.describe_position(step) {
            m.insert("data.position".into(), p);
        }
        m
    }
    fn resume(&mut self, step: u64, meta: &Metadata) -> Result<(), TrainError> {
        if let Windows::Sequential { .. } = self.train {
            let windows = match meta.get("data.windows") {
                Some(w) => w.parse::<u64>().map_err(|e| TrainError::Layout {
                    detail: format!("the checkpoint's data.windows {w:?} is not a count: {e}"),
                })?,
                None => self.train.windows_before(step)?,
            };
            self.train.resume_at(StreamOrigin { step, windows });
        }
        self.prefetch = None;
        self.ready = None;
        Ok(())
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
}

/// Shared token sequences for windows over a corpus.
pub fn corpus_windows(
    corpus: &data::Corpus,
    seed: u64,
    batch: usize,
    seq_len: usize,
) -> Result<(Windows, Windows), TrainError> {
    let tokens: Arc<[u32]> = corpus.tokens();
    let make = |part: std::ops::Range<usize>, seed: u64| -> Result<Windows, TrainError> {
        let sampler = data::WindowSampler::new(part.len(), seed, batch, seq_len).map_err(|e| {
            TrainError::Layout {
                detail: format!("--seq-len {seq_len}: {}: {e}", corpus.source),
            }
        })?;
        Ok(Windows::Random {
            sampler,
            tokens: Arc::clone(&tokens),
            part,
        })
    };
    Ok((
        make(corpus.train_range(), seed)?,
        make(corpus.heldout_range(), !seed)?,
    ))
}
