//! `RmsNorm` over the last dim with a learned scale (no shift).

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
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(&self.weight.compute()?, self.eps)
    }
}

impl Module for RmsNorm {
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.weight.clone()]
    }
}
