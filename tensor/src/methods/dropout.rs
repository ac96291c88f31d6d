//! The `Tensor` methods of the dropout family (`op/dropout.rs`): they build its ops
//! and dispatch them.

use oxiflow_sbp::Shape;

use crate::dispatch::dispatch;
use crate::op::{DropoutOp, F64Bits};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

impl Tensor {
    /// Dropout with drop probability `p` in `[0, 1)` and mask seed `seed`: element `i` (global
    /// row-major index) is kept, scaled by `1 / (1 - p)`, when `rng::uniform(seed, i) >= p`,
    /// else zeroed. `p == 0` returns the input itself.
    pub fn dropout(&self, p: f64, seed: u64) -> Result<Tensor> {
        let zeros = vec![0; self.shape().ndim()];
        self.dropout_in(p, seed, &self.shape().clone(), &zeros)
    }

    /// Dropout as part of a larger tensor of shape `frame` in which this one starts at index
    /// `at` on each dim: the mask is the frame's (from its row-major indices), so a micro-batch
    /// drops what its rows of the whole batch would. `frame` must hold this tensor at `at`.
    pub fn dropout_in(&self, p: f64, seed: u64, frame: &Shape, at: &[usize]) -> Result<Tensor> {
        let shape = self.shape();
        let inside = frame.ndim() == shape.ndim()
            && at.len() == shape.ndim()
            && frame.checked_numel().is_some()
            && (0..shape.ndim()).all(|d| {
                at[d]
                    .checked_add(shape.dim(d))
                    .is_some_and(|end| end <= frame.dim(d))
            });
        if !inside {
            return Err(TensorError::Shape {
                op: "dropout",
                shapes: shape.to_string(),
                sbps: self.nd_sbp().map(|s| s.to_string()).unwrap_or_default(),
                detail: format!(
                    "a tensor of shape {shape} does not lie in the frame {frame} at {at:?}"
                ),
            });
        }
        if p == 0.0 && self.dtype().is_float() {
            return Ok(self.clone());
        }
        let op = DropoutOp {
            p: F64Bits::new(p),
            seed,
            global: frame.clone(),
            starts: at.iter().copied().collect(),
        };
        dispatch(op.into(), &[self])
    }
}
