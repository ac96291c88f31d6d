//! `Norm`: a block's norm as the architecture names it, LayerNorm or RMSNorm, with the residual
//! sum it follows (one fused op for LayerNorm).

use crate::Result;
use oxiflow_tensor::Tensor;

use super::super::init::ParamPlacement;
use super::super::layer_norm::LayerNorm;
use super::super::param::{Module, Parameter};
use super::super::rms_norm::RmsNorm;
use super::arch::{Arch, NormKind};
use super::config::GptConfig;

/// LayerNorm (`name.weight`, `name.bias`) or RMSNorm (`name.weight`) over the width.
#[derive(Clone, Debug)]
pub enum Norm {
    Layer(LayerNorm),
    Rms(RmsNorm),
}

impl Norm {
    /// The norm `arch` names over `cfg`'s width, at `at`.
    pub fn new(name: &str, cfg: &GptConfig, arch: &Arch, at: &ParamPlacement) -> Result<Norm> {
        let (c, eps, d) = (cfg.width, arch.norm_eps, cfg.dtype);
        Ok(match arch.norm {
            NormKind::LayerNorm => Norm::Layer(LayerNorm::new(name, c, eps, d, at)?),
            NormKind::RmsNorm => Norm::Rms(RmsNorm::new(name, c, eps, d, at)?),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Layer(n) => n.forward(x),
            Norm::Rms(n) => n.forward(x),
        }
    }

    /// The residual sum `r = x + a` and this norm of it, `(r, norm(r))`.
    pub fn forward_residual(&self, x: &Tensor, a: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            Norm::Layer(n) => n.forward_residual(x, a),
            Norm::Rms(n) => {
                let r = x.add(a)?;
                let y = n.forward(&r)?;
                Ok((r, y))
            }
        }
    }
}

impl Module for Norm {
    fn parameters(&self) -> Vec<Parameter> {
        match self {
            Norm::Layer(n) => n.parameters(),
            Norm::Rms(n) => n.parameters(),
        }
    }
}
