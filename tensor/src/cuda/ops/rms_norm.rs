//! RMS-norm on CUDA, composed from the element-wise and reduction kernels:
//! `x * (mean(x^2) + eps)^-1/2 * weight`.

use oxiflow_sbp::Shape;

use super::super::storage::CudaStorage;
use super::{float_only, CudaKernels};
use crate::op::{
    BinaryOp, ElementwiseKernels, OutSpec, ReductionKernels, RmsNormKernels, ScalarOp, UnaryOp,
};
use crate::Result;

impl RmsNormKernels for CudaKernels {
    fn rms_norm(
        &self,
        x: &CudaStorage,
        w: &CudaStorage,
        eps: f64,
        out: &OutSpec,
    ) -> Result<CudaStorage> {
        float_only("rms_norm", x.dtype)?;
        let last = x.shape.ndim().saturating_sub(1);
        let spec = |shape: Shape| OutSpec {
            shape,
            dtype: x.dtype,
        };
        let full = spec(x.shape.clone());
        let rows = spec(x.shape.with_dim(last, 1));
        let h = x.shape.dims().last().copied().unwrap_or(1);
        let sq = self.unary(UnaryOp::Square, x, &full)?;
        let ms = self.sum(&sq, &[last], true, Some(h), &rows)?;
        let r = self.scalar(ScalarOp::Add, eps, &ms, &rows)?;
        let r = self.scalar(ScalarOp::Pow, -0.5, &r, &rows)?;
        let xhat = self.binary(BinaryOp::Mul, x, &r, &full)?;
        self.binary(BinaryOp::Mul, &xhat, w, out)
    }
}
