//! `RmsNorm` over the last dim with a learned scale (no shift), one fused op; 16-bit inputs
//! normalise in f32.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use crate::Result;
use oxiflow_tensor::Tensor;

use super::init::{Init, ParamPlacement};
use super::param::{Module, Parameter};

/// RMS norm over the last dim of size `dim`: `name.weight` (ones).
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub weight: Parameter,
    pub eps: f64,
}

impl RmsNorm {
    pub fn new(
        name: &str,
        dim: usize,
        eps: f64,
        dtype: DType,
        at: &ParamPlacement,
    ) -> Result<RmsNorm> {
        let w = Init::Ones.build(Shape::new([dim]), dtype, at)?;
        Ok(RmsNorm {
            weight: Parameter::new(format!("{name}.weight"), &w),
            eps,
        })
    }
    /// The norm of `x` as one fused op (`oxiflow_ops::rms_norm`), the weight in `x`'s dtype:
    /// a 16-bit `x` is normalised in f32 and rounded once.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut w = self.weight.compute()?;
        if w.dtype() != x.dtype() {
            w = w.to_dtype(x.dtype())?;
        }
        oxiflow_ops::rms_norm::rms_norm(x, &w, self.eps)
    }
}

impl Module for RmsNorm {
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.weight.clone()]
    }
}
