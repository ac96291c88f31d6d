//! `RmsNorm` over the last dim with a learned scale (no shift); 16-bit inputs normalise in f32.

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
    /// The norm of `x`; a 16-bit `x` is normalised in f32 (with its weight cast to f32) and
    /// the result cast back, as for LayerNorm under mixed precision.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.compute()?;
        match x.dtype() {
            DType::BF16 | DType::F16 => x
                .to_dtype(DType::F32)?
                .rms_norm(&w.to_dtype(DType::F32)?, self.eps)?
                .to_dtype(x.dtype()),
            _ => x.rms_norm(&w, self.eps),
        }
    }
}

impl Module for RmsNorm {
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.weight.clone()]
    }
}
