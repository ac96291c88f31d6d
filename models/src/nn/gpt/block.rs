//! One pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)), with Megatron tensor
//! parallelism and, optionally, sequence parallelism between the parallel regions; the norms,
//! the attention and the MLP as the architecture (`Arch`) names them.

use oxiflow_sbp::{Sbp, Shape};

use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::super::init::param_seed;
use super::super::linear::{Linear, Parallel};
use super::super::param::{Module, Parameter};
use super::arch::{Arch, MlpKind};
use super::attention::{CausalSelfAttention, KvSlot};
use super::config::{GptConfig, GptLayout, TP_AXIS};
use super::norm::Norm;
use crate::nn::Pass;

impl Pass {
    /// The dropout probability and mask seed of site `site` in this pass.
    pub(super) fn dropout_at(self, cfg: &GptConfig, site: &str) -> Option<(f64, u64)> {
        match self {
            Pass::Train { step } | Pass::TrainMicro { step, .. } if cfg.dropout > 0.0 => Some((
                cfg.dropout,
                param_seed(cfg.seed, &format!("dropout.{site}.{step}")),
            )),
            _ => None,
        }
    }

    /// `x` (batch first) through this pass's dropout at `site`.
    pub(super) fn dropout(self, cfg: &GptConfig, site: &str, x: &Tensor) -> Result<Tensor> {
        let Some((p, seed)) = self.dropout_at(cfg, site) else {
            return Ok(x.clone());
        };
        match self {
            Pass::TrainMicro { index, count, .. } if x.shape().ndim() > 0 => {
                let rows = x.shape().dim(0);
                let overflow = || TensorError::Shape {
                    op: "Gpt dropout",
                    shapes: x.shape().to_string(),
                    sbps: String::new(),
                    detail: format!("micro-batch {index} of {count} overflows the batch"),
                };
                let mut frame = x.shape().dims().to_vec();
                frame[0] = rows.checked_mul(count).ok_or_else(overflow)?;
                let mut at = vec![0; frame.len()];
                at[0] = rows.checked_mul(index).ok_or_else(overflow)?;
                Ok(x.dropout_in(p, seed, &Shape::new(frame), &at)?)
            }
            _ => Ok(x.dropout(p, seed)?),
        }
    }
}

/// The MLP of a block. GELU: `name.fc` `[C, F]` (column-parallel) -> GELU -> `name.proj`
/// `[F, C]` (row-parallel). SwiGLU: `name.gate` and `name.up` `[C, F]` (column-parallel) ->
/// `silu(gate) * up` -> `name.down` `[F, C]` (row-parallel); `fc` is `up`, `proj` is `down`.
#[derive(Clone, Debug)]
pub struct GptMlp {
    pub fc: Linear,
    pub gate: Option<Linear>,
    pub proj: Linear,
}

impl GptMlp {
    pub fn new(name: &str, cfg: &GptConfig, arch: &Arch, layout: &GptLayout) -> Result<GptMlp> {
        let (c, f) = (cfg.width, arch.ffn(cfg));
        let opts = |parallel| layout.linear_biased(cfg, parallel, arch.mlp_bias);
        let (column, row) = (
            opts(Parallel::Column(TP_AXIS)),
            opts(Parallel::Row(TP_AXIS)),
        );
        let (fc, proj, gate) = match arch.mlp {
            MlpKind::Gelu => ("fc", "proj", None),
            MlpKind::SwiGlu => ("up", "down", Some("gate")),
        };
        Ok(GptMlp {
            gate: gate
                .map(|g| Linear::new(&format!("{name}.{g}"), c, f, &column))
                .transpose()?,
            fc: Linear::new(&format!("{name}.{fc}"), c, f, &column)?,
            proj: Linear::new(&format!("{name}.{proj}"), f, c, &row)?,
        })
    }

    /// The hidden activation of h (whole on the tensor-parallel axis): `gelu(fc(h))`, or
    /// `silu(gate(h)) * up(h)`.
    pub fn hidden(&self, h: &Tensor) -> Result<Tensor> {
        match &self.gate {
            None => self.fc.forward_gelu(h),
            Some(gate) => {
                let g = gate.forward(h)?;
                g.mul(&g.sigmoid()?)?.mul(&self.fc.forward(h)?)
            }
        }
    }

    /// `residual + proj(gelu(fc(h)))` as one fused op (`Tensor::residual_mlp`) where both
    /// layers compute with weights and biases whole on every rank (no tensor parallelism;
    /// ZeRO-3 shards are gathered) and carry no adapter; None otherwise (the layers compose). `recompute_hidden`:
    /// GELU's output is computed again in the backward instead of kept.
    pub fn fused_residual(
        &self,
        h: &Tensor,
        residual: &Tensor,
        recompute_hidden: bool,
    ) -> Result<Option<Tensor>> {
        let (Some(b_fc), Some(b_proj), None) = (&self.fc.bias, &self.proj.bias, &self.gate) else {
            return Ok(None);
        };
        if self.proj.is_partial() || self.fc.lora.is_some() || self.proj.lora.is_some() {
            return Ok(None);
        }
        // The values the layers compute with (a ZeRO-3 shard gathered whole).
        let w = [&self.fc.weight, b_fc, &self.proj.weight, b_proj]
            .map(Parameter::compute)
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        if w.iter().any(|t| t.has_sbp_over_ranks(|s| s != Sbp::B)) {
            return Ok(None);
        }
        Ok(Some(h.residual_mlp_with(
            &w[0],
            &w[1],
            &w[2],
            &w[3],
            residual,
            recompute_hidden,
        )?))
    }
}

/// A row-parallel projection whose partial sums are reduced straight into `stream` on the
/// tensor-parallel axis (B: all-reduce; S(1): reduce-scatter along the sequence), then biased;
/// a weight whole on that axis is one fused op (the bias in the product's epilogue).
fn row_parallel(lin: &Linear, x: &Tensor, layout: &GptLayout, stream: Sbp) -> Result<Tensor> {
    if !lin.is_partial() {
        return layout.relayout(&lin.forward(x)?, stream);
    }
    let y = layout.relayout(&lin.product(x)?, stream)?;
    match &lin.bias {
        Some(b) => y.add(&b.compute()?),
        None => Ok(y),
    }
}

/// `name.ln1`, `name.attn`, `name.ln2`, `name.mlp`.
#[derive(Clone, Debug)]
pub struct Block {
    pub ln1: Norm,
    pub attn: CausalSelfAttention,
    pub ln2: Norm,
    pub mlp: GptMlp,
    name: String,
}

impl Block {
    pub fn new(name: &str, cfg: &GptConfig, arch: &Arch, layout: &GptLayout) -> Result<Block> {
        let ln = |n: &str| Norm::new(n, cfg, arch, &layout.replicated());
        Ok(Block {
            ln1: ln(&format!("{name}.ln1"))?,
            attn: CausalSelfAttention::with_arch(&format!("{name}.attn"), cfg, arch, layout)?,
            ln2: ln(&format!("{name}.ln2"))?,
            mlp: GptMlp::new(&format!("{name}.mlp"), cfg, arch, layout)?,
            name: name.to_string(),
        })
    }

    /// x `[B, T, C]` laid out as `stream` on the tensor-parallel axis (B, or S(1) under sequence
    /// parallelism) -> the same layout. Norms and residuals run on that layout; each parallel
    /// region gathers its input to B and reduces its output back into `stream`.
    /// Under `Recompute::Full` the whole block, under `Selective` its attention sublayer, keeps
    /// only its input for the backward pass and runs again there (dropout masks are keyed by
    /// the step, so the rerun draws the same ones).
    pub fn forward(
        &self,
        x: &Tensor,
        cfg: &GptConfig,
        layout: &GptLayout,
        stream: Sbp,
        pass: Pass,
        recompute: Recompute,
    ) -> Result<Tensor> {
        if recompute == Recompute::Full {
            let (b, cfg, layout) = (self.clone(), cfg.clone(), layout.clone());
            return oxiflow_tensor::recompute(&[x], move |v| {
                b.forward(&v[0], &cfg, &layout, stream, pass, Recompute::None)
            });
        }
        let a = if recompute == Recompute::Selective {
            let (b, layout) = (self.clone(), layout.clone());
            oxiflow_tensor::recompute(&[x], move |v| b.attention_part(&v[0], &layout, stream))?
        } else {
            self.attention_part(x, layout, stream)?
        };
        self.after_attention(x, &a, cfg, layout, stream, pass, recompute)
    }

    /// [`Block::forward`] in evaluation of the next positions of the sequences whose keys and
    /// values `cache` holds (see `KvCache`), which it extends.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        cfg: &GptConfig,
        layout: &GptLayout,
        stream: Sbp,
        cache: &mut KvSlot,
    ) -> Result<Tensor> {
        let h = layout.relayout(&self.ln1.forward(x)?, Sbp::B)?;
        let a = row_parallel(
            &self.attn.proj,
            &self.attn.attend_cached(&h, cache)?,
            layout,
            stream,
        )?;
        self.after_attention(x, &a, cfg, layout, stream, Pass::Eval, Recompute::None)
    }

    /// The rest of the block after the attention sublayer's output `a` (reduced into
    /// `stream`): the residual, ln2 and the MLP.
    #[allow(clippy::too_many_arguments)]
    fn after_attention(
        &self,
        x: &Tensor,
        a: &Tensor,
        cfg: &GptConfig,
        layout: &GptLayout,
        stream: Sbp,
        pass: Pass,
        recompute: Recompute,
    ) -> Result<Tensor> {
        // The residual add and ln2 are one op, which gives the sum too.
        let a = pass.dropout(cfg, &format!("{}.attn", self.name), a)?;
        let (x, h) = self.ln2.forward_residual(x, &a)?;
        let h = layout.relayout(&h, Sbp::B)?;
        let site = format!("{}.mlp", self.name);
        if pass.dropout_at(cfg, &site).is_none() {
            let recompute_hidden = recompute == Recompute::Gelu;
            if let Some(y) = self.mlp.fused_residual(&h, &x, recompute_hidden)? {
                return layout.relayout(&y, stream);
            }
        }
        let h = self.mlp.hidden(&h)?;
        let m = row_parallel(&self.mlp.proj, &h, layout, stream)?;
        x.add(&pass.dropout(cfg, &site, &m)?)
    }
}

impl Block {
    /// ln1, attention and the row-parallel output projection, reduced into `stream`.
    fn attention_part(&self, x: &Tensor, layout: &GptLayout, stream: Sbp) -> Result<Tensor> {
        let h = layout.relayout(&self.ln1.forward(x)?, Sbp::B)?;
        row_parallel(&self.attn.proj, &self.attn.attend(&h)?, layout, stream)
    }
}

impl Module for GptMlp {
    fn parameters(&self) -> Vec<Parameter> {
        let mut v: Vec<Parameter> = self.gate.iter().flat_map(|g| g.parameters()).collect();
        v.extend(self.fc.parameters());
        v.extend(self.proj.parameters());
        v
    }
}

/// What a block keeps for its backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Every intermediate tensor the ops' backward rules need.
    #[default]
    None,
    /// Only the block's input; the whole block runs again in the backward pass.
    Full,
    /// Only the attention sublayer's input; that sublayer runs again.
    Selective,
    /// Everything but the MLP's hidden activation (GELU's output, `[.., 4C]`): the fused MLP's
    /// backward computes it again from the kept pre-activation, one element-wise pass a block
    /// (a tensor-parallel MLP, composed of its layers, keeps it).
    Gelu,
}

impl Module for Block {
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = self.ln1.parameters();
        v.extend(self.attn.parameters());
        v.extend(self.ln2.parameters());
        v.extend(self.mlp.parameters());
        v
    }
}
