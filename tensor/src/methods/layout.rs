//! The `Tensor` methods of the layout family (`op/layout.rs`): they build its ops
//! and dispatch them.

use oxiflow_sbp::Shape;

use crate::dispatch::dispatch;
use crate::op::{norm_dim, Dims, LayoutOp};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

fn layout(op: LayoutOp, inputs: &[&Tensor]) -> Result<Tensor> {
    dispatch(op.into(), inputs)
}

impl Tensor {
    /// Output dim i is input dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let perm = perm.iter().copied().collect();
        layout(LayoutOp::Permute { perm }, &[self])
    }
    /// Swaps two dims.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let (a, b) = (
            norm_dim("transpose", self, d0)?,
            norm_dim("transpose", self, d1)?,
        );
        let mut perm: Dims = (0..self.ndim()).collect();
        perm.swap(a, b);
        layout(LayoutOp::Permute { perm }, &[self])
    }
    /// Row-major reshape (same element count).
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        layout(LayoutOp::Reshape { shape }, &[self])
    }
    /// Concatenates tensors along `dim`.
    pub fn concat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return Err(TensorError::Shape {
                op: "concat",
                shapes: String::new(),
                sbps: String::new(),
                detail: "no inputs".into(),
            });
        };
        let dim = norm_dim("concat", first, dim)?;
        layout(LayoutOp::Concat { dim }, tensors)
    }
    /// Elements `start..start + len` of `dim`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let dim = norm_dim("narrow", self, dim)?;
        layout(LayoutOp::Narrow { dim, start, len }, &[self])
    }
    /// Elements `start..start + len` of a 1-d tensor, sharing its memory where the backend
    /// can (devices; the host copies them): a view, as a reshape is.
    pub fn elements(&self, start: usize, len: usize) -> Result<Tensor> {
        layout(LayoutOp::Elements { start, len }, &[self])
    }
    /// Elements `start..end` of `dim`.
    pub fn slice(&self, dim: isize, start: usize, end: usize) -> Result<Tensor> {
        self.narrow(dim, start, end.saturating_sub(start))
    }
}
