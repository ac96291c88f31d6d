//! What the loop trains: a `TrainModel` (its loss on a batch, its pipeline view when split,
//! which parameters take weight decay, its FLOPs per token) fed by a `BatchSource` (this rank's
//! part of every step's micro-batches, held-out batches, and a position checkpoints carry).

use oxiflow_models::checkpoint::Metadata;
use oxiflow_models::nn::{Module, Parameter, Pass};
use oxiflow_models::pipeline::PipelineModel;
use oxiflow_tensor::Tensor;

use crate::error::TrainError;

/// This rank's part of a (micro-)batch: inputs on the first stage's placement, targets on the
/// last stage's (the same placement without pipeline stages).
#[derive(Clone, Debug)]
pub struct Batch {
    pub inputs: Tensor,
    pub targets: Tensor,
}

/// A model the loop trains under any layout.
pub trait TrainModel: Module {
    /// The mean loss of `batch` (a 0-d tensor, with history when gradients are on).
    fn loss(&self, batch: &Batch, pass: Pass) -> Result<Tensor, TrainError>;
    /// The model as pipeline stages, when it is split into them or into micro-batches.
    fn pipeline(&self) -> Option<&dyn PipelineModel> {
        None
    }
    /// Whether `p` takes weight decay (by default the matrices: no biases or norms).
    fn decays(&self, p: &Parameter) -> bool {
        p.value().ndim() == 2
    }
    /// Training FLOPs (forward and backward) per token or sample, for the FLOPs utilisation.
    fn flops_per_token(&self) -> Option<f64> {
        None
    }
}

/// Where a job's batches come from.
pub trait BatchSource {
    /// Rows per step (the global batch).
    fn batch_size(&self) -> usize;
    /// Tokens per row (1 for samples that are not sequences).
    fn tokens_per_row(&self) -> usize;
    /// Micro-batch `index` of `count` of step `step`: this rank's part of rows
    /// `[index B / count, (index + 1) B / count)` of the step's global batch of B rows.
    fn train_batch(&mut self, step: u64, index: usize, count: usize) -> Result<Batch, TrainError>;
    /// Held-out batch `i` (of `heldout_batches()` fixed ones).
    fn heldout_batch(&mut self, i: u64) -> Result<Batch, TrainError>;
    /// How many held-out batches an evaluation averages.
    fn heldout_batches(&self) -> u64;
    /// Metadata a checkpoint at step `step` records to continue the stream (`data.*` keys);
    /// by default the step alone (`data.step`), for a stream that is a function of the step.
    fn position(&self, step: u64) -> Metadata {
        Metadata::from([("data.step".to_string(), step.to_string())])
    }
    /// Continues the stream as a checkpoint at step `step` with metadata `meta` recorded it; by
    /// default nothing (a stream that is a function of the step continues by itself).
    fn resume(&mut self, step: u64, meta: &Metadata) -> Result<(), TrainError> {
        let _ = (step, meta);
        Ok(())
    }
    /// Where the data comes from, for the log.
    fn describe(&self) -> String;
}
