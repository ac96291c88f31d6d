//! Parameter initialisation from the counter-based RNG, and where a parameter lives.

use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::{NdSbp, Shape};

use crate::Result;
use oxiflow_tensor::no_grad;
use oxiflow_tensor::Tensor;

/// Where a parameter lives: a local tensor, or a global one with a placement and nd-SBP.
#[derive(Clone, Debug, PartialEq)]
pub enum ParamPlacement {
    Local,
    Global { placement: Placement, nd_sbp: NdSbp },
}

/// How a parameter's initial value is drawn. Random values depend only on the seed and the
/// global element index (never on the layout).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    /// Normal(0, std^2).
    Normal {
        seed: u64,
        std: f64,
    },
    /// Uniform in [-bound, bound).
    Uniform {
        seed: u64,
        bound: f64,
    },
}

/// A seed for parameter `name` of a model seeded with `seed` (FNV-1a of the name, mixed).
pub fn param_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Init {
    /// The initial tensor of `shape` at `at` (no autograd history).
    pub fn build(self, shape: Shape, dtype: DType, at: &ParamPlacement) -> Result<Tensor> {
        let _ng = no_grad();
        let t = match at {
            ParamPlacement::Local => match self {
                Init::Zeros => Tensor::try_zeros(shape, dtype)?,
                Init::Ones => Tensor::try_ones(shape, dtype)?,
                Init::Normal { seed, std } => Tensor::try_randn(shape, seed, dtype)?.scale(std)?,
                Init::Uniform { seed, bound } => Tensor::try_rand(shape, seed, dtype)?
                    .scale(2.0 * bound)?
                    .sub_scalar(bound)?,
            },
            ParamPlacement::Global {
                placement: p,
                nd_sbp: s,
            } => match self {
                Init::Zeros => Tensor::zeros_global(shape, dtype, p, s.clone())?,
                Init::Ones => Tensor::ones_global(shape, dtype, p, s.clone())?,
                Init::Normal { seed, std } => {
                    Tensor::randn_global(shape, seed, dtype, p, s.clone())?.scale(std)?
                }
                Init::Uniform { seed, bound } => {
                    Tensor::rand_global(shape, seed, dtype, p, s.clone())?
                        .scale(2.0 * bound)?
                        .sub_scalar(bound)?
                }
            },
        };
        Ok(t.detach())
    }
}
