//! Embedding CPU kernels, written into the executor's output buffer: row lookup and its
//! backward (scatter-add of dy rows into the weight), the index-select and index-add of the
//! gather kernels on dim 0.

use super::gather::{put, take, Addressing};
use super::CpuBackend;
use crate::op::{kernel_err, EmbeddingKernels, IndexShard};
use crate::storage::CpuArray;
use crate::Result;

impl EmbeddingKernels for CpuBackend {
    fn embedding(
        &self,
        ids: &CpuArray,
        weight: &CpuArray,
        shard: IndexShard,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "embedding";
        if weight.shape().len() != 2 || weight.dtype() == crate::DType::I64 {
            return Err(kernel_err(op, "needs a 2-d float weight".into()));
        }
        take(op, weight, ids, (0, Addressing::PerPosition, shard), out)
    }
    fn embedding_backward(
        &self,
        ids: &CpuArray,
        dy: &CpuArray,
        shard: IndexShard,
        out: &mut CpuArray,
    ) -> Result<()> {
        put(
            "embedding_backward",
            ids,
            dy,
            (0, Addressing::PerPosition, shard),
            out,
        )
    }
}
