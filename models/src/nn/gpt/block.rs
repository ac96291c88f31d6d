//! One pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)), with Megatron tensor
//! parallelism and, optionally, sequence parallelism between the parallel regions; the norms,
//! the attention and the MLP as the architecture (`Arch`) names them.

use oxiflow_sbp::{Sbp, Shape};

use crate::shape_error::shape_err;
use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::super::init::param_seed;
use super::super::linear::Linear;
use super::super::param::{Module, Parameter};
use super::arch::Arch;
use super::attention::{CausalSelfAttention, KvSlot};
use super::config::{GptConfig, GptLayout};
use super::fused_gate_up::FusedGateUp;
use super::fused_qkv::FusedQkv;
use super::mlp::GptMlp;
use super::moe::{MoeMlp, RouterLog};
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

/// A block's MLP: dense, or a mixture of experts.
#[derive(Clone, Debug)]
// One per block, built once and matched per step: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum BlockMlp {
    Dense(GptMlp),
    Moe(MoeMlp),
}

/// `name.ln1`, `name.attn`, `name.ln2`, `name.mlp`.
#[derive(Clone, Debug)]
pub struct Block {
    pub ln1: Norm,
    pub attn: CausalSelfAttention,
    pub ln2: Norm,
    pub mlp: BlockMlp,
    name: String,
}

impl Block {
    pub fn new(name: &str, cfg: &GptConfig, arch: &Arch, layout: &GptLayout) -> Result<Block> {
        let ln = |n: &str| Norm::new(n, cfg, arch, &layout.replicated());
        Ok(Block {
            ln1: ln(&format!("{name}.ln1"))?,
            attn: CausalSelfAttention::with_arch(&format!("{name}.attn"), cfg, arch, layout)?,
            ln2: ln(&format!("{name}.ln2"))?,
            mlp: match &arch.moe {
                None => BlockMlp::Dense(GptMlp::new(&format!("{name}.mlp"), cfg, arch, layout)?),
                Some(moe) => {
                    BlockMlp::Moe(MoeMlp::new(&format!("{name}.mlp"), cfg, arch, moe, layout)?)
                }
            },
            name: name.to_string(),
        })
    }

    /// x `[B, T, C]` laid out as `stream` on the tensor-parallel axis (B, or S(1) under sequence
    /// parallelism) -> the same layout. Norms and residuals run on that layout; each parallel
    /// region gathers its input to B and reduces its output back into `stream`.
    /// Under `Recompute::Full` the whole block, under `Selective` its attention sublayer, keeps
    /// only its input for the backward pass and runs again there (dropout masks are keyed by
    /// the step, so the rerun draws the same ones). A mixture of experts' routing statistics
    /// are dropped (see [`Block::forward_routed`]).
    pub fn forward(
        &self,
        x: &Tensor,
        cfg: &GptConfig,
        layout: &GptLayout,
        stream: Sbp,
        pass: Pass,
        recompute: Recompute,
    ) -> Result<Tensor> {
        let mut log = RouterLog::default();
        self.forward_routed(x, cfg, layout, stream, pass, recompute, &mut log)
    }

    /// [`Block::forward`], adding a mixture of experts' routing statistics to `log`. A
    /// mixture's block refuses `Recompute::Full` (its statistics would carry no gradient).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_routed(
        &self,
        x: &Tensor,
        cfg: &GptConfig,
        layout: &GptLayout,
        stream: Sbp,
        pass: Pass,
        recompute: Recompute,
        log: &mut RouterLog,
    ) -> Result<Tensor> {
        if recompute == Recompute::Full {
            if let BlockMlp::Moe(_) = self.mlp {
                return Err(shape_err(
                    "Block::forward",
                    x,
                    format!(
                        "{}: full recomputation of a mixture-of-experts block is not supported \
                         (use selective recomputation)",
                        self.name
                    ),
                ));
            }
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
        self.after_attention(x, &a, cfg, layout, stream, (pass, recompute, None), log)
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
        let o = self.attn.attend_cached(&h, cache)?;
        self.decoded(x, &o, cfg, layout, stream, None)
    }

    /// One position x `[B, 1, C]` at the device position `pos` through the block, attending
    /// over the keys and values `cache` holds before it (see
    /// [`CausalSelfAttention::attend_at`]): the block's output and the position's key and
    /// value, for the caller to write into the cache. `fused`: the attention's fused
    /// query/key/value projection and the MLP's fused gate/up, where it has them.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_at(
        &self,
        x: &Tensor,
        cfg: &GptConfig,
        layout: &GptLayout,
        stream: Sbp,
        cache: (&Tensor, &Tensor),
        pos: &Tensor,
        fused: (Option<&FusedQkv>, Option<&FusedGateUp>),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let h = layout.relayout(&self.ln1.forward(x)?, Sbp::B)?;
        let (o, k, v) = self.attn.attend_at(&h, cache, pos, fused.0)?;
        Ok((self.decoded(x, &o, cfg, layout, stream, fused.1)?, k, v))
    }

    /// The block's output in evaluation for x and its attended values `o` (before the output
    /// projection): the projection, the residual, ln2 and the MLP (its gate and up one product
    /// with `gate_up`).
    fn decoded(
        &self,
        x: &Tensor,
        o: &Tensor,
        cfg: &GptConfig,
        layout: &GptLayout,
        stream: Sbp,
        gate_up: Option<&FusedGateUp>,
    ) -> Result<Tensor> {
        let a = row_parallel(&self.attn.proj, o, layout, stream)?;
        let mut log = RouterLog::default();
        let how = (Pass::Eval, Recompute::None, gate_up);
        self.after_attention(x, &a, cfg, layout, stream, how, &mut log)
    }

    /// The rest of the block after the attention sublayer's output `a` (reduced into
    /// `stream`): the residual, ln2 and the MLP, in `pass` keeping what `recompute` says (a
    /// dense MLP's gate and up one product with a fused `gate_up`).
    #[allow(clippy::too_many_arguments)]
    fn after_attention(
        &self,
        x: &Tensor,
        a: &Tensor,
        cfg: &GptConfig,
        layout: &GptLayout,
        stream: Sbp,
        (pass, recompute, gate_up): (Pass, Recompute, Option<&FusedGateUp>),
        log: &mut RouterLog,
    ) -> Result<Tensor> {
        // The residual add and ln2 are one op, which gives the sum too.
        let a = pass.dropout(cfg, &format!("{}.attn", self.name), a)?;
        let (x, h) = self.ln2.forward_residual(x, &a)?;
        let h = layout.relayout(&h, Sbp::B)?;
        let site = format!("{}.mlp", self.name);
        let m = match &self.mlp {
            BlockMlp::Dense(mlp) => {
                if pass.dropout_at(cfg, &site).is_none() {
                    let recompute_hidden = recompute == Recompute::Gelu;
                    if let Some(y) = mlp.fused_residual(&h, &x, recompute_hidden)? {
                        return layout.relayout(&y, stream);
                    }
                }
                row_parallel(&mlp.proj, &mlp.hidden_with(&h, gate_up)?, layout, stream)?
            }
            BlockMlp::Moe(moe) => {
                let (y, stats) = moe.forward(&h)?;
                log.add(stats)?;
                layout.relayout(&y, stream)?
            }
        };
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

impl Module for BlockMlp {
    fn parameters(&self) -> Vec<Parameter> {
        match self {
            BlockMlp::Dense(m) => m.parameters(),
            BlockMlp::Moe(m) => m.parameters(),
        }
    }
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
