//! `Linear`: y = x W + b with W `[in, out]`; replicated, column-parallel (W split on its output
//! features over a mesh axis, Megatron's first MLP layer) or row-parallel (split on its input
//! features, the second layer; its output is a partial sum that inference reduces lazily).
//! Unless its weight is split on its input features over several ranks, the layer is one fused
//! op (the product with the bias, and GELU in `forward_gelu`, in its epilogue). A LoRA adapter
//! (`attach_lora`) adds its low-rank product to the layer's, before the activation.

use oxiflow_dtype::DType;
use oxiflow_ops::linear::linear_at;
use oxiflow_placement::Placement;
use oxiflow_sbp::{NdSbp, Sbp, Shape};

use crate::{Result, TensorError};
use oxiflow_ops::linear::Activation;
use oxiflow_tensor::Tensor;

use super::init::{param_seed, Init, ParamPlacement};
use super::lora::{Lora, LoraOptions, LoraSite};
use super::param::{Module, Parameter};

/// How a layer's weight is split over the tensor-parallel mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Parallel {
    /// Every rank holds the whole weight (B on every axis).
    #[default]
    Replicated,
    /// Split the output features over mesh axis `axis`: W `S(1)`, bias `S(0)`.
    Column(usize),
    /// Split the input features over mesh axis `axis`: W `S(0)`, bias `B`.
    Row(usize),
}

/// Options of a `Linear` (see `Default`: f32, bias, seed 0, local, replicated).
#[derive(Clone, Debug)]
pub struct LinearOptions {
    pub bias: bool,
    pub seed: u64,
    pub dtype: DType,
    /// None: local parameters; Some: global parameters on this placement.
    pub placement: Option<Placement>,
    pub parallel: Parallel,
}

impl Default for LinearOptions {
    fn default() -> Self {
        LinearOptions {
            bias: true,
            seed: 0,
            dtype: DType::F32,
            placement: None,
            parallel: Parallel::Replicated,
        }
    }
}

/// nd-SBP that is B on every axis but `axis`, where it is `sbp`.
fn on_axis(placement: &Placement, axis: Option<usize>, sbp: Sbp) -> NdSbp {
    let mut s = NdSbp::broadcast(placement.ndim());
    if let Some(a) = axis {
        s.set(a, sbp);
    }
    s
}

/// y = x W + b, W `[in, out]`, initialised uniform in ±1/sqrt(in) (bias zeros).
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Parameter,
    pub bias: Option<Parameter>,
    pub in_features: usize,
    pub out_features: usize,
    /// The weight is split on its input features over several ranks: the product is a
    /// partial sum, reduced before the bias is added (so never the fused op).
    partial: bool,
    /// How the weight is split, and where it lives (what an adapter follows).
    parallel: Parallel,
    placement: Option<Placement>,
    /// The low-rank adapter added to the product, when attached.
    pub lora: Option<Lora>,
}

impl Linear {
    /// A linear layer named `name` (parameters `name.weight`, `name.bias`).
    pub fn new(
        name: &str,
        in_features: usize,
        out_features: usize,
        o: &LinearOptions,
    ) -> Result<Linear> {
        let (wp, bp) = match &o.placement {
            None => (ParamPlacement::Local, ParamPlacement::Local),
            Some(p) => {
                let (ws, bs) = match o.parallel {
                    Parallel::Replicated => (on_axis(p, None, Sbp::B), on_axis(p, None, Sbp::B)),
                    Parallel::Column(a) | Parallel::Row(a) if a >= p.ndim() => {
                        return Err(TensorError::Sbp {
                            op: "Linear::new",
                            shapes: format!("[{in_features}, {out_features}]"),
                            sbps: format!("{:?}", o.parallel),
                            placement: p.to_string(),
                            detail: format!("mesh axis {a} out of range"),
                        })
                    }
                    Parallel::Column(a) => (
                        on_axis(p, Some(a), Sbp::S(1)),
                        on_axis(p, Some(a), Sbp::S(0)),
                    ),
                    Parallel::Row(a) => (on_axis(p, Some(a), Sbp::S(0)), on_axis(p, None, Sbp::B)),
                };
                (
                    ParamPlacement::Global {
                        placement: p.clone(),
                        nd_sbp: ws,
                    },
                    ParamPlacement::Global {
                        placement: p.clone(),
                        nd_sbp: bs,
                    },
                )
            }
        };
        let wname = format!("{name}.weight");
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let w = Init::Uniform {
            seed: param_seed(o.seed, &wname),
            bound,
        }
        .build(Shape::new([in_features, out_features]), o.dtype, &wp)?;
        let bias = if o.bias {
            let b = Init::Zeros.build(Shape::new([out_features]), o.dtype, &bp)?;
            Some(Parameter::new(format!("{name}.bias"), &b))
        } else {
            None
        };
        let partial = match (o.parallel, &o.placement) {
            (Parallel::Row(a), Some(p)) => p.shape().get(a).is_some_and(|&n| n > 1),
            _ => false,
        };
        Ok(Linear {
            weight: Parameter::new(wname, &w),
            bias,
            in_features,
            out_features,
            partial,
            parallel: o.parallel,
            placement: o.placement.clone(),
            lora: None,
        })
    }

    /// Attaches a fresh LoRA adapter `name.lora_A` / `name.lora_B` of `options` (split as the
    /// weight is, in the weight's dtype, seeded by `seed`) and freezes the layer's own
    /// parameters: only the adapter trains. The layer's name is its weight's without `.weight`.
    /// A layer takes one adapter.
    pub fn attach_lora(&mut self, options: LoraOptions, seed: u64) -> Result<()> {
        let wname = self.weight.name();
        let name = wname.strip_suffix(".weight").unwrap_or(wname).to_string();
        if self.lora.is_some() {
            return Err(TensorError::Shape {
                op: "Linear::attach_lora",
                shapes: format!("[{}, {}]", self.in_features, self.out_features),
                sbps: "-".into(),
                detail: format!("layer {name} has an adapter already"),
            });
        }
        let (a_at, b_at) = self.adapter_layouts();
        let lora = Lora::new(
            &LoraSite {
                name: &name,
                in_features: self.in_features,
                out_features: self.out_features,
                a_at,
                b_at,
                dtype: self.weight.value().dtype(),
                seed,
            },
            options,
        )?;
        self.weight.freeze();
        if let Some(b) = &self.bias {
            b.freeze();
        }
        self.lora = Some(lora);
        Ok(())
    }

    /// Where an adapter's A `[in, r]` and B `[r, out]` live: column-parallel splits B as the
    /// weight (on its output features) and replicates A; row-parallel splits A as the weight
    /// (on its input features) and replicates B.
    fn adapter_layouts(&self) -> (ParamPlacement, ParamPlacement) {
        let Some(p) = &self.placement else {
            return (ParamPlacement::Local, ParamPlacement::Local);
        };
        let at = |axis, sbp| ParamPlacement::Global {
            placement: p.clone(),
            nd_sbp: on_axis(p, axis, sbp),
        };
        match self.parallel {
            Parallel::Replicated => (at(None, Sbp::B), at(None, Sbp::B)),
            Parallel::Column(a) => (at(None, Sbp::B), at(Some(a), Sbp::S(1))),
            Parallel::Row(a) => (at(Some(a), Sbp::S(0)), at(None, Sbp::B)),
        }
    }

    /// The weight with the adapter merged in (`W + (alpha / r) A B`, see `Lora::merged`), or
    /// the weight itself without an adapter.
    pub fn merged_weight(&self) -> Result<Tensor> {
        match &self.lora {
            Some(l) => l.merged(&self.weight.value()),
            None => Ok(self.weight.value()),
        }
    }

    /// x `[.., in]` times the weight, plus the adapter's product when attached: a partial sum
    /// when the layer is (see [`Linear::is_partial`]); no bias.
    pub fn product(&self, x: &Tensor) -> Result<Tensor> {
        let mp = self.weight.matmul_precision();
        let y = x.matmul_at(&self.weight.compute()?, mp)?;
        match &self.lora {
            Some(l) => y.add(&l.delta(x)?),
            None => Ok(y),
        }
    }

    /// Whether the weight is split on its input features over several ranks (row-parallel on
    /// a mesh axis of more than one rank): the product is a partial sum there.
    pub fn is_partial(&self) -> bool {
        self.partial
    }

    /// x `[.., in]` -> `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_as(x, Activation::None)
    }

    /// `gelu(x W + b)` (tanh form), fused into the product's epilogue where it can be.
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_as(x, Activation::Gelu)
    }

    fn forward_as(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        let b = self.bias.as_ref().map(Parameter::compute).transpose()?;
        let mp = self.weight.matmul_precision();
        if let Some(l) = &self.lora {
            // The base product as without the adapter (one fused op where it can be), then the
            // adapter's term, then the activation.
            let y = match (&b, self.partial) {
                (Some(b), false) => {
                    linear_at(x, &self.weight.compute()?, Some(b), Activation::None, mp)?
                        .add(&l.delta(x)?)?
                }
                (Some(b), true) => self.product(x)?.add(b)?,
                (None, _) => self.product(x)?,
            };
            return match act {
                Activation::Gelu => y.gelu(),
                Activation::None => Ok(y),
            };
        }
        let w = self.weight.compute()?;
        if !self.partial && (b.is_some() || act != Activation::None) {
            return linear_at(x, &w, b.as_ref(), act, mp);
        }
        let y = x.matmul_at(&w, mp)?;
        let y = match &b {
            Some(b) => y.add(b)?,
            None => y,
        };
        Ok(match act {
            Activation::Gelu => y.gelu()?,
            Activation::None => y,
        })
    }
}

impl Module for Linear {
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = vec![self.weight.clone()];
        v.extend(self.bias.clone());
        v.extend(self.lora.iter().flat_map(Lora::parameters));
        v
    }
}
