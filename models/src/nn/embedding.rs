//! `Embedding`: rows of a weight `[num, dim]` looked up by i64 ids.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use crate::Result;
use oxiflow_tensor::Tensor;

use super::init::{param_seed, Init, ParamPlacement};
use super::param::{Module, Parameter};

/// An embedding table `name.weight` `[num, dim]`, initialised Normal(0, 1).
#[derive(Clone, Debug)]
pub struct Embedding {
    pub weight: Parameter,
}

impl Embedding {
    pub fn new(
        name: &str,
        num: usize,
        dim: usize,
        seed: u64,
        dtype: DType,
        at: &ParamPlacement,
    ) -> Result<Embedding> {
        let wname = format!("{name}.weight");
        let w = Init::Normal {
            seed: param_seed(seed, &wname),
            std: 1.0,
        }
        .build(Shape::new([num, dim]), dtype, at)?;
        Ok(Embedding {
            weight: Parameter::new(wname, &w),
        })
    }
    /// ids `[..]` (i64) -> `[.., dim]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Tensor::embedding(ids, &self.weight.compute()?)
    }
}

impl Module for Embedding {
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.weight.clone()]
    }
}
