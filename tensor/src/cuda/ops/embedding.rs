//! Embedding CUDA kernels, written into the executor's output piece: row lookup and the scatter-add of its weight gradient, the
//! index-select and index-add of the gather kernels on dim 0.

use super::super::derr;
use super::super::storage::CudaStorage;
use super::gather::{put, take, Along};
use super::{float_only, CudaKernels};
use crate::op::{EmbeddingKernels, IndexShard};
use crate::Result;

impl EmbeddingKernels for CudaKernels {
    fn embedding(
        &self,
        ids: &CudaStorage,
        w: &CudaStorage,
        shard: IndexShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let op = "embedding";
        if w.shape.ndim() != 2 {
            return Err(derr(op, "needs a 2-d float weight"));
        }
        float_only(op, w.dtype)?;
        let along = Along {
            dim: 0,
            per_elem: false,
            shard,
        };
        take(self, op, w, ids, along, out)
    }

    fn embedding_backward(
        &self,
        ids: &CudaStorage,
        dy: &CudaStorage,
        shard: IndexShard,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let along = Along {
            dim: 0,
            per_elem: false,
            shard,
        };
        put(self, "embedding_backward", ids, dy, along, out)
    }
}
