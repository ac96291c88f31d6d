//! The `Tensor` methods of the gather family (`op/gather.rs`): they build its ops
//! and dispatch them.

use crate::dispatch::dispatch;
use crate::op::{norm_dim, Addressing, GatherOp, IndexShard};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// torch.gather: `out[.., j, ..] = self[.., index[.., j, ..], ..]` along `dim`; `index`
    /// (i64) has `self`'s shape on every other dim, and the output has index's shape.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let dim = norm_dim("gather", self, dim)?;
        let shard = IndexShard::default();
        dispatch(GatherOp::Gather { dim, shard }.into(), &[self, index])
    }
    /// The slices of `self` along `dim` at `ids` (1-d i64), in order.
    pub fn index_select(&self, dim: isize, ids: &Tensor) -> Result<Tensor> {
        let dim = norm_dim("index_select", self, dim)?;
        let shard = IndexShard::default();
        dispatch(GatherOp::IndexSelect { dim, shard }.into(), &[self, ids])
    }
    /// Zeros of `index`'s shape with `dim` of size `size`, plus `src` (index's shape) added at
    /// the indices along `dim` (the gradient of `gather`).
    pub fn scatter_add(index: &Tensor, src: &Tensor, dim: isize, size: usize) -> Result<Tensor> {
        let dim = norm_dim("scatter_add", index, dim)?;
        let op = GatherOp::adding(Addressing::PerElement, dim, size, false);
        dispatch(op.into(), &[index, src])
    }
    /// Zeros of `src`'s shape with `dim` of size `size`, plus the slices of `src` along `dim`
    /// added at `ids` (1-d i64; the gradient of `index_select`).
    pub fn index_add(ids: &Tensor, src: &Tensor, dim: isize, size: usize) -> Result<Tensor> {
        let dim = norm_dim("index_add", src, dim)?;
        let op = GatherOp::adding(Addressing::PerPosition, dim, size, false);
        dispatch(op.into(), &[ids, src])
    }
}
