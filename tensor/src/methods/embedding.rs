//! The `Tensor` methods of the embedding family (`op/embedding.rs`): they build its ops
//! and dispatch them.

use crate::dispatch::dispatch;
use crate::op::{EmbeddingOp, IndexShard};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Rows of `weight [V, H]` at `ids [..]` (i64) -> `[.., H]`. A global weight may be split
    /// on the vocabulary (S(0)); with ids B the output is then P(sum).
    pub fn embedding(ids: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let shard = IndexShard::default();
        dispatch(EmbeddingOp::Lookup { shard }.into(), &[ids, weight])
    }
    /// Weight gradient `[num, H]` of an embedding lookup: scatter-add of dy rows at ids.
    pub fn embedding_backward(ids: &Tensor, dy: &Tensor, num: usize) -> Result<Tensor> {
        let op = EmbeddingOp::Backward {
            num,
            vocab_split: false,
            shard: IndexShard::default(),
        };
        dispatch(op.into(), &[ids, dy])
    }
}
