//! The `Tensor` methods of the mask family (`op/mask.rs`): they build its ops
//! and dispatch them.

use crate::dispatch::dispatch;
use crate::op::{triangular, F64Bits, MaskOp, Triangle};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// `a` where `cond` is nonzero, else `b` (all three broadcast; `cond` of any dtype).
    pub fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        dispatch(MaskOp::Where.into(), &[cond, a, b])
    }
    /// `self` with `value` where `mask` (any dtype, broadcasting to `self`) is nonzero.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let value = F64Bits::new(value);
        dispatch(MaskOp::MaskedFill { value }.into(), &[self, mask])
    }
    /// The upper triangle of the last two dims from diagonal `k` on (`col - row >= k`), zeros
    /// elsewhere.
    pub fn triu(&self, k: i64) -> Result<Tensor> {
        triangular(self, Triangle::Upper, k)
    }
    /// The lower triangle of the last two dims up to diagonal `k` (`col - row <= k`), zeros
    /// elsewhere.
    pub fn tril(&self, k: i64) -> Result<Tensor> {
        triangular(self, Triangle::Lower, k)
    }
}
