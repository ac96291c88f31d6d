//! The `Tensor` methods of the rotary family (`op/rotary.rs`): they build its ops
//! and dispatch them.

use crate::dispatch::dispatch;
use crate::op::{norm_dim, F64Bits, RotaryOp};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Rotary position embedding of `[.., T, .., D]` (D even) with positions along `seq_dim`
    /// (not the last dim): pairs (i, i + D/2) rotate by `pos * base^(-2i/D)`.
    pub fn rotary(&self, seq_dim: isize, base: f64) -> Result<Tensor> {
        self.rotary_from(seq_dim, base, 0)
    }

    /// [`Tensor::rotary`] for positions from `pos0` on (a decoding step's).
    pub fn rotary_from(&self, seq_dim: isize, base: f64, pos0: usize) -> Result<Tensor> {
        let op = RotaryOp {
            seq_dim: norm_dim("rotary", self, seq_dim)?,
            base: F64Bits::new(base),
            inverse: false,
            pos0,
        };
        dispatch(op.into(), &[self])
    }
}
