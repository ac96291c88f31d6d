//! `Mlp`: Linear -> activation -> Linear, Megatron style when given a tensor-parallel axis
//! (column-parallel first layer, row-parallel second: one reduction per block, done by boxing).

use oxiflow_dtype::DType;
use oxiflow_placement::Placement;

use crate::Result;
use oxiflow_tensor::Tensor;

use super::linear::{Linear, LinearOptions, Parallel};
use super::param::{Module, Parameter};

/// The hidden activation of an `Mlp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Activation {
    #[default]
    Relu,
    Gelu,
    Tanh,
}

/// Two linear layers `name.fc1` `[d_in, hidden]` and `name.fc2` `[hidden, d_out]`.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
    pub activation: Activation,
}

impl Mlp {
    /// `placement` None: local; `tp_axis` Some(a): fc1 column-parallel and fc2 row-parallel on
    /// mesh axis `a`, otherwise replicated.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        d_in: usize,
        hidden: usize,
        d_out: usize,
        activation: Activation,
        seed: u64,
        dtype: DType,
        placement: Option<&Placement>,
        tp_axis: Option<usize>,
    ) -> Result<Mlp> {
        let base = LinearOptions {
            bias: true,
            seed,
            dtype,
            placement: placement.cloned(),
            parallel: Parallel::Replicated,
        };
        let (p1, p2) = match tp_axis {
            Some(a) if placement.is_some() => (Parallel::Column(a), Parallel::Row(a)),
            _ => (Parallel::Replicated, Parallel::Replicated),
        };
        let fc1 = Linear::new(
            &format!("{name}.fc1"),
            d_in,
            hidden,
            &LinearOptions {
                parallel: p1,
                ..base.clone()
            },
        )?;
        let fc2 = Linear::new(
            &format!("{name}.fc2"),
            hidden,
            d_out,
            &LinearOptions {
                parallel: p2,
                ..base
            },
        )?;
        Ok(Mlp {
            fc1,
            fc2,
            activation,
        })
    }
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = match self.activation {
            Activation::Relu => self.fc1.forward(x)?.relu()?,
            Activation::Gelu => self.fc1.forward_gelu(x)?,
            Activation::Tanh => self.fc1.forward(x)?.tanh()?,
        };
        self.fc2.forward(&h)
    }
}

impl Module for Mlp {
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = self.fc1.parameters();
        v.extend(self.fc2.parameters());
        v
    }
}
