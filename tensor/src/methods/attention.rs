//! The `Tensor` methods of the attention family (`op/attention.rs`): they build its ops
//! and dispatch them.

use oxiflow_dtype::MatmulPrecision;

use crate::dispatch::dispatch;
use crate::op::{AttentionOp, F64Bits};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// The attention probabilities `softmax(self k^T * scale + mask)`, `[B, H, T, S]`, for
    /// queries `self` `[B, H, T, D]` and keys `k` `[B, H, S, D]` (with `causal`, S == T and
    /// query `i` attends to keys `0..=i`; masked entries are 0). The fused attention that never
    /// makes this array is `oxiflow_ops::attention::flash_attention`.
    pub fn attention_probs(&self, k: &Tensor, causal: bool, scale: f64) -> Result<Tensor> {
        self.attention_probs_at(k, causal, scale, MatmulPrecision::F32)
    }
    /// [`Tensor::attention_probs`] with f32 products at `precision` on a device.
    pub fn attention_probs_at(
        &self,
        k: &Tensor,
        causal: bool,
        scale: f64,
        precision: MatmulPrecision,
    ) -> Result<Tensor> {
        let scale = F64Bits::new(scale);
        let op = AttentionOp {
            causal,
            scale,
            precision,
        };
        dispatch(op.into(), &[self, k])
    }
}
