//! `LayerNorm` over the last dim with a learned scale and shift.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use crate::Result;
use oxiflow_ops::residual_layer_norm::residual_layer_norm;
use oxiflow_tensor::Tensor;

use super::init::{Init, ParamPlacement};
use super::param::{Module, Parameter};

/// Layer norm over the last dim of size `dim`: `name.weight` (ones) and `name.bias` (zeros).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub weight: Parameter,
    pub bias: Parameter,
    pub eps: f64,
}

impl LayerNorm {
    pub fn new(
        name: &str,
        dim: usize,
        eps: f64,
        dtype: DType,
        at: &ParamPlacement,
    ) -> Result<LayerNorm> {
        let w = Init::Ones.build(Shape::new([dim]), dtype, at)?;
        let b = Init::Zeros.build(Shape::new([dim]), dtype, at)?;
        Ok(LayerNorm {
            weight: Parameter::new(format!("{name}.weight"), &w),
            bias: Parameter::new(format!("{name}.bias"), &b),
            eps,
        })
    }
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.weight.compute()?, &self.bias.compute()?, self.eps)
    }
    /// The residual sum `r = x + a` and this norm of it, `(r, LayerNorm(r))`, as one op.
    pub fn forward_residual(&self, x: &Tensor, a: &Tensor) -> Result<(Tensor, Tensor)> {
        let (w, b) = (self.weight.compute()?, self.bias.compute()?);
        residual_layer_norm(x, a, &w, &b, self.eps)
    }
}

impl Module for LayerNorm {
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.weight.clone(), self.bias.clone()]
    }
}
