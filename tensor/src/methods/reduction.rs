//! The `Tensor` methods of the reduction family (`op/reduction.rs`): they build its ops
//! and dispatch them.

use oxiflow_sbp::Shape;

use crate::dispatch::dispatch;
use crate::op::{norm_dims, ReductionOp};
use crate::tensor::Tensor;
use crate::Result;

fn reduction(op: ReductionOp, x: &Tensor) -> Result<Tensor> {
    dispatch(op.into(), &[x])
}

impl Tensor {
    /// Sum over `dims` (negative dims count from the end).
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = norm_dims("sum", self, dims)?;
        reduction(ReductionOp::Sum { dims, keepdim }, self)
    }
    /// Sum of all elements (0-d result).
    pub fn sum_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.ndim() as isize).collect();
        self.sum(&dims, false)
    }
    /// Mean over `dims`: the sum times 1 / (the global count of reduced elements).
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = norm_dims("mean", self, dims)?;
        reduction(
            ReductionOp::Mean {
                dims,
                keepdim,
                count: 0,
            },
            self,
        )
    }
    pub fn mean_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.ndim() as isize).collect();
        self.mean(&dims, false)
    }
    /// Max over `dims`.
    pub fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = norm_dims("max", self, dims)?;
        reduction(ReductionOp::Max { dims, keepdim }, self)
    }
    /// Min over `dims`.
    pub fn min(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = norm_dims("min", self, dims)?;
        reduction(ReductionOp::Min { dims, keepdim }, self)
    }
    /// Sums broadcast dims away so the result has `shape` (gradient of broadcasting).
    pub fn sum_to_shape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        reduction(ReductionOp::SumToShape { shape }, self)
    }
}
