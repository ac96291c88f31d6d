//! `Lora`: a low-rank adapter of a linear layer, `y = x W + (alpha / r) x A B` (Hu et al.,
//! PEFT's `LoraLayer` without dropout). With the layer's `[in, out]` convention A is
//! `[in, r]` and B `[r, out]`, the transposes of PEFT's `lora_A.weight` `[r, in]` and
//! `lora_B.weight` `[out, r]`. A starts as PEFT's Kaiming-uniform with a = sqrt(5) (uniform in
//! ±1/sqrt(in)), B at zero, so a new adapter leaves the layer's function unchanged. Under tensor
//! parallelism the adapter follows its layer's split: column-parallel (W split on its output
//! features) splits B the same way and replicates A; row-parallel (W split on its input
//! features) splits A on its rows and replicates B, so `x A B` is the same partial sum the base
//! product is, reduced with it.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::init::{param_seed, Init, ParamPlacement};
use super::param::Parameter;

/// The size of an adapter: rank `r` and the scale's numerator `alpha` (scale `alpha / r`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraOptions {
    pub rank: usize,
    pub alpha: f64,
}

impl LoraOptions {
    /// The factor of the adapter's product, `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank.max(1) as f64
    }

    /// Checks the rank against a layer `[in_features, out_features]` named `layer`: at least 1
    /// and at most min(in, out) (a higher rank is no longer low), and a finite alpha.
    pub fn check(&self, layer: &str, in_features: usize, out_features: usize) -> Result<()> {
        let most = in_features.min(out_features);
        let detail = if self.rank == 0 {
            Some("rank 0: an adapter needs a rank of at least 1".to_string())
        } else if self.rank > most {
            Some(format!(
                "rank {} is above min(in {in_features}, out {out_features}) = {most}",
                self.rank
            ))
        } else if !self.alpha.is_finite() {
            Some(format!("alpha {} is not finite", self.alpha))
        } else {
            None
        };
        match detail {
            Some(d) => Err(TensorError::Shape {
                op: "Lora::new",
                shapes: format!("[{in_features}, {out_features}]"),
                sbps: "-".into(),
                detail: format!("LoRA adapter of {layer}: {d}"),
            }),
            None => Ok(()),
        }
    }
}

/// Where a layer's base weight lives, for its adapter to follow.
#[derive(Clone, Debug)]
pub struct LoraSite<'a> {
    /// The layer's name (`h.0.attn.q`): the adapter's parameters are `name.lora_A`, `name.lora_B`.
    pub name: &'a str,
    pub in_features: usize,
    pub out_features: usize,
    /// Where A `[in, r]` and B `[r, out]` live (see the module docs).
    pub a_at: ParamPlacement,
    pub b_at: ParamPlacement,
    /// The adapter's dtype (the model's master dtype).
    pub dtype: DType,
    pub seed: u64,
}

/// A low-rank adapter (see the module docs).
#[derive(Clone, Debug)]
pub struct Lora {
    /// `[in, r]`: PEFT's `lora_A.weight` transposed.
    pub a: Parameter,
    /// `[r, out]`: PEFT's `lora_B.weight` transposed.
    pub b: Parameter,
    pub options: LoraOptions,
}

impl Lora {
    /// A fresh adapter of the layer at `site` (A Kaiming-uniform, B zero).
    pub fn new(site: &LoraSite, options: LoraOptions) -> Result<Lora> {
        options.check(site.name, site.in_features, site.out_features)?;
        let (aname, bname) = (
            format!("{}.lora_A", site.name),
            format!("{}.lora_B", site.name),
        );
        // PEFT: kaiming_uniform_(a = sqrt(5)) on [r, in]: gain sqrt(2 / 6), bound
        // gain * sqrt(3 / in) = 1 / sqrt(in).
        let a = Init::Uniform {
            seed: param_seed(site.seed, &aname),
            bound: 1.0 / (site.in_features.max(1) as f64).sqrt(),
        }
        .build(
            Shape::new([site.in_features, options.rank]),
            site.dtype,
            &site.a_at,
        )?;
        let b = Init::Zeros.build(
            Shape::new([options.rank, site.out_features]),
            site.dtype,
            &site.b_at,
        )?;
        Ok(Lora {
            a: Parameter::new(aname, &a),
            b: Parameter::new(bname, &b),
            options,
        })
    }

    /// `(alpha / r) x A B` for x `[.., in]`, in x's dtype: a partial sum where the base product
    /// is one (row-parallel).
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let (a, b) = (self.a.compute()?, self.b.compute()?);
        let (a, b) = if a.dtype() != x.dtype() {
            (a.to_dtype(x.dtype())?, b.to_dtype(x.dtype())?)
        } else {
            (a, b)
        };
        let mp = self.a.matmul_precision();
        x.matmul_at(&a, mp)?
            .matmul_at(&b, mp)?
            .mul_scalar(self.options.scale())
    }

    /// `w + (alpha / r) A B` for the base weight `w` `[in, out]` (in w's layout and dtype),
    /// computed in the adapter's dtype: the merged weight.
    pub fn merged(&self, w: &Tensor) -> Result<Tensor> {
        let _ng = oxiflow_tensor::no_grad();
        let ab = self
            .a
            .value()
            .detach()
            .matmul(&self.b.value().detach())?
            .mul_scalar(self.options.scale())?;
        let merged = w.detach().to_dtype(ab.dtype())?.add(&ab)?;
        let merged = match (w.placement(), w.nd_sbp()) {
            (Some(p), Some(nd)) => merged.to_global(p, nd.clone())?,
            _ => merged,
        };
        merged.to_dtype(w.dtype())
    }

    /// A and B.
    pub fn parameters(&self) -> Vec<Parameter> {
        vec![self.a.clone(), self.b.clone()]
    }
}
