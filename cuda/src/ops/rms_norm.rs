//! RMS-norm on CUDA, composed from the element-wise and reduction kernels:
//! `x * (mean(x^2) + eps)^-1/2 * weight`.

use oxiflow_sbp::Shape;

use super::super::storage::CudaStorage;
use super::{float_only, CudaKernels};
use oxiflow_tensor::backend::{ElementwiseKernels, ReductionKernels, RmsNormKernels};
use oxiflow_tensor::Result;
use oxiflow_tensor::{BinaryOp, KernelBackend, OutSpec, ScalarOp, UnaryOp};

impl RmsNormKernels for CudaKernels {
    fn rms_norm(
        &self,
        x: &CudaStorage,
        w: &CudaStorage,
        eps: f64,
        out: &mut CudaStorage,
    ) -> Result<()> {
        float_only("rms_norm", x.dtype)?;
        let last = x.shape.ndim().saturating_sub(1);
        let spec = |shape: Shape| OutSpec {
            shape,
            dtype: x.dtype,
        };
        let (full, rows) = (spec(x.shape.clone()), spec(x.shape.with_dim(last, 1)));
        let h = x.shape.dims().last().copied().unwrap_or(1);
        // Scratch pieces for the intermediate steps; the last writes `out`.
        let step = |spec: &OutSpec, f: &dyn Fn(&mut CudaStorage) -> Result<()>| {
            let mut t = self.alloc(spec)?;
            f(&mut t)?;
            Ok::<_, oxiflow_tensor::TensorError>(t)
        };
        let sq = step(&full, &|t| self.unary(UnaryOp::Square, x, t))?;
        let ms = step(&rows, &|t| self.sum(&sq, &[last], true, Some(h), t))?;
        let r = step(&rows, &|t| self.scalar(ScalarOp::Add, eps, &ms, t))?;
        let r = step(&rows, &|t| self.scalar(ScalarOp::Pow, -0.5, &r, t))?;
        let xhat = step(&full, &|t| self.binary(BinaryOp::Mul, x, &r, t))?;
        self.binary(BinaryOp::Mul, &xhat, w, out)
    }
}
