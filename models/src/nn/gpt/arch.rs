//! `Arch`: what distinguishes the members of the decoder family (GPT-2, Llama, Qwen2, Mistral)
//! beyond their sizes, as Hugging Face configurations say it: the norm and its epsilon,
//! learned or rotary positions (with `llama3` or `linear` frequency scaling), a GELU or SwiGLU
//! MLP and its width, multi-head or grouped-query attention, which projections carry biases,
//! whether the output projection is the token table, and whether the MLP is a mixture of
//! experts (`MoeArch`). `GptConfig` holds the sizes shared by every member; `Arch::gpt2` is
//! the GPT the crate trained first, unchanged.

use crate::{Result, TensorError};

use super::config::{GptConfig, GptLayout};

/// LayerNorm epsilon of GPT-2's norms.
pub const LN_EPS: f64 = 1e-5;

/// The normalisation of the residual stream before each sublayer and before the head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `(x - mean) / sqrt(var + eps) * weight + bias`.
    LayerNorm,
    /// `x / sqrt(mean(x^2) + eps) * weight` (no bias).
    RmsNorm,
}

/// How rotary frequencies are rescaled for a context longer than the one trained on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every inverse frequency divided by `factor` (positions interpolated).
    Linear {
        factor: f64,
    },
    /// Llama 3's: wavelengths above `original / low_freq_factor` divided by `factor`, below
    /// `original / high_freq_factor` kept, and a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_positions: usize,
    },
}

/// Where a token's position enters the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Positions {
    /// A learned table `wpe` `[seq_len, C]` added to the token embeddings.
    Learned,
    /// Rotary embedding of each head's queries and keys (GPT-NeoX layout: pairs (i, i + D/2)),
    /// base `theta`.
    Rotary { theta: f64, scaling: RopeScaling },
}

/// The MLP of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// `proj(gelu_tanh(fc(x)))`.
    Gelu,
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
}

/// The members' differences (see the module docs). Sizes live in `GptConfig`.
#[derive(Clone, Debug, PartialEq)]
pub struct Arch {
    pub norm: NormKind,
    pub norm_eps: f64,
    pub positions: Positions,
    pub mlp: MlpKind,
    /// The MLP's hidden width (None: 4 C).
    pub ffn_width: Option<usize>,
    /// Key/value heads (None: as many as query heads); query heads share them in groups.
    pub kv_heads: Option<usize>,
    /// Biases on the query, key and value projections.
    pub qkv_bias: bool,
    /// A bias on the attention's output projection.
    pub out_bias: bool,
    /// Biases on the MLP's projections.
    pub mlp_bias: bool,
    /// The output projection is the token table (else a table `lm_head` of its own).
    pub tie_embeddings: bool,
    /// Every block's MLP is a mixture of these SwiGLU experts (None: the dense MLP).
    pub moe: Option<MoeArch>,
}

impl Default for Arch {
    fn default() -> Self {
        Arch::gpt2()
    }
}

fn arch_err(detail: String) -> TensorError {
    TensorError::Shape {
        op: "Arch::validate",
        shapes: "-".into(),
        sbps: "-".into(),
        detail,
    }
}

impl Arch {
    /// GPT-2: LayerNorm (eps 1e-5), learned positions, GELU MLP of width 4 C, multi-head
    /// attention, biases everywhere, tied embeddings.
    pub fn gpt2() -> Arch {
        Arch {
            norm: NormKind::LayerNorm,
            norm_eps: LN_EPS,
            positions: Positions::Learned,
            mlp: MlpKind::Gelu,
            ffn_width: None,
            kv_heads: None,
            qkv_bias: true,
            out_bias: true,
            mlp_bias: true,
            tie_embeddings: true,
            moe: None,
        }
    }

    /// Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases, an
    /// output table of its own; `kv_heads`, `ffn_width`, `theta` and `eps` as given.
    pub fn llama(kv_heads: usize, ffn_width: usize, theta: f64, eps: f64) -> Arch {
        Arch {
            norm: NormKind::RmsNorm,
            norm_eps: eps,
            positions: Positions::Rotary {
                theta,
                scaling: RopeScaling::None,
            },
            mlp: MlpKind::SwiGlu,
            ffn_width: Some(ffn_width),
            kv_heads: Some(kv_heads),
            qkv_bias: false,
            out_bias: false,
            mlp_bias: false,
            tie_embeddings: false,
            moe: None,
        }
    }

    /// The MLP's hidden width for `cfg`.
    pub fn ffn(&self, cfg: &GptConfig) -> usize {
        self.ffn_width.unwrap_or(4 * cfg.width)
    }

    /// Key/value heads for `cfg`.
    pub fn kv(&self, cfg: &GptConfig) -> usize {
        self.kv_heads.unwrap_or(cfg.heads)
    }

    /// Whether the key/value projections split their heads over a tensor-parallel axis of
    /// `tp` ranks: when there are at least as many key/value heads as ranks and they divide
    /// evenly; otherwise every rank computes every key/value head (replicated).
    pub fn kv_split(&self, cfg: &GptConfig, tp: usize) -> bool {
        let kv = self.kv(cfg);
        kv >= tp && kv.is_multiple_of(tp)
    }

    /// Checks the architecture against the sizes and the layout (heads split over the
    /// tensor-parallel axis).
    pub fn validate(&self, cfg: &GptConfig, layout: &GptLayout) -> Result<()> {
        let kv = self.kv(cfg);
        if kv == 0 || !cfg.heads.is_multiple_of(kv) {
            return Err(arch_err(format!(
                "key/value heads {kv} must be at least 1 and divide the query heads {}",
                cfg.heads
            )));
        }
        if self.ffn(cfg) == 0 {
            return Err(arch_err("the MLP width must be at least 1".into()));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(arch_err(format!(
                "norm epsilon {} is not a finite number above 0",
                self.norm_eps
            )));
        }
        if let Positions::Rotary { theta, scaling } = self.positions {
            if !(theta.is_finite() && theta > 0.0) {
                return Err(arch_err(format!(
                    "rope theta {theta} is not a finite number above 0"
                )));
            }
            if !cfg.head_dim().is_multiple_of(2) {
                return Err(arch_err(format!(
                    "rotary positions need an even head width, got {} (width {} / heads {})",
                    cfg.head_dim(),
                    cfg.width,
                    cfg.heads
                )));
            }
            scaling.validate()?;
        }
        if let Some(moe) = &self.moe {
            moe.validate(layout.tp())?;
        }
        if layout.placement().is_some() && self.moe.is_none() {
            let tp = layout.tp();
            if !self.ffn(cfg).is_multiple_of(tp) {
                return Err(arch_err(format!(
                    "the MLP width {} must be divisible by the tensor-parallel degree {tp}",
                    self.ffn(cfg)
                )));
            }
        }
        Ok(())
    }

    /// The inverse frequencies of the rotary embedding of heads `head_dim` wide (None for
    /// learned positions): `theta^(-2i/D)` for `i < D/2`, then scaled.
    pub fn inv_freq(&self, head_dim: usize) -> Option<Vec<f64>> {
        let Positions::Rotary { theta, scaling } = self.positions else {
            return None;
        };
        let d = head_dim as f64;
        Some(
            (0..head_dim / 2)
                .map(|i| scaling.apply(1.0 / theta.powf(2.0 * i as f64 / d)))
                .collect(),
        )
    }

    /// The number of parameters of a model of `cfg` with a token table of `table_rows` rows.
    pub fn parameter_count(&self, cfg: &GptConfig, table_rows: usize) -> usize {
        let (c, hd) = (cfg.width, cfg.head_dim());
        let (q, kv, f) = (cfg.heads * hd, self.kv(cfg) * hd, self.ffn(cfg));
        let norm = match self.norm {
            NormKind::LayerNorm => 2 * c,
            NormKind::RmsNorm => c,
        };
        let attn = c * (q + 2 * kv)
            + q * c
            + usize::from(self.qkv_bias) * (q + 2 * kv)
            + usize::from(self.out_bias) * c;
        let mlp = match (&self.moe, self.mlp) {
            (Some(moe), _) => moe.parameter_count(c),
            (None, MlpKind::Gelu) => 2 * c * f + usize::from(self.mlp_bias) * (f + c),
            (None, MlpKind::SwiGlu) => 3 * c * f + usize::from(self.mlp_bias) * (2 * f + c),
        };
        let tables = table_rows * c * if self.tie_embeddings { 1 } else { 2 };
        let positions = match self.positions {
            Positions::Learned => cfg.seq_len * c,
            Positions::Rotary { .. } => 0,
        };
        tables + positions + cfg.layers * (2 * norm + attn + mlp) + norm
    }
}

/// What makes a block's MLP a mixture of experts (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeArch {
    /// Routed experts per block.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// The k routing weights are divided by their sum (Mixtral; Qwen2-MoE's `norm_topk_prob`).
    pub renormalize: bool,
    /// Hidden width of each routed expert.
    pub expert_width: usize,
    /// Hidden width of a shared expert every token visits, scaled by `sigmoid(x w)`.
    pub shared_width: Option<usize>,
    /// Weight of the load-balancing loss in the training loss.
    pub aux_loss_coef: f64,
}

fn moe_err(detail: String) -> TensorError {
    TensorError::Shape {
        op: "MoeArch::validate",
        shapes: "-".into(),
        sbps: "-".into(),
        detail,
    }
}

impl MoeArch {
    /// Checks the sizes against each other and the tensor-parallel degree `tp`.
    pub fn validate(&self, tp: usize) -> Result<()> {
        if self.experts == 0 {
            return Err(moe_err(
                "a mixture of experts needs at least 1 expert".into(),
            ));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(moe_err(format!(
                "the router's top-k {} must be between 1 and the expert count {}",
                self.top_k, self.experts
            )));
        }
        for (what, w) in [
            ("expert width", Some(self.expert_width)),
            ("shared expert width", self.shared_width),
        ] {
            match w {
                Some(0) => return Err(moe_err(format!("the {what} must be at least 1"))),
                Some(w) if !w.is_multiple_of(tp) => {
                    return Err(moe_err(format!(
                        "the {what} {w} must be divisible by the tensor-parallel degree {tp}"
                    )))
                }
                _ => {}
            }
        }
        if !(self.aux_loss_coef.is_finite() && self.aux_loss_coef >= 0.0) {
            return Err(moe_err(format!(
                "the router's auxiliary loss coefficient {} is not a finite number >= 0",
                self.aux_loss_coef
            )));
        }
        Ok(())
    }

    /// Parameters of one block's mixture for width `c`.
    pub fn parameter_count(&self, c: usize) -> usize {
        let shared = self.shared_width.map_or(0, |s| 3 * c * s + c);
        c * self.experts + self.experts * 3 * c * self.expert_width + shared
    }

    /// `(name, shape)` of one block's mixture parameters under `name`, in `parameters()` order.
    pub fn parameter_shapes(&self, name: &str, c: usize) -> Vec<(String, Vec<usize>)> {
        let mut v = vec![(format!("{name}.router.weight"), vec![c, self.experts])];
        let swiglu = |v: &mut Vec<(String, Vec<usize>)>, at: String, f: usize| {
            v.push((format!("{at}.gate.weight"), vec![c, f]));
            v.push((format!("{at}.up.weight"), vec![c, f]));
            v.push((format!("{at}.down.weight"), vec![f, c]));
        };
        let (e, f) = (self.experts, self.expert_width);
        v.push((format!("{name}.experts.gate.weight"), vec![e, c, f]));
        v.push((format!("{name}.experts.up.weight"), vec![e, c, f]));
        v.push((format!("{name}.experts.down.weight"), vec![e, f, c]));
        if let Some(s) = self.shared_width {
            swiglu(&mut v, format!("{name}.shared"), s);
            v.push((format!("{name}.shared_gate.weight"), vec![c, 1]));
        }
        v
    }
}

impl RopeScaling {
    fn validate(self) -> Result<()> {
        let positive = |what: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(arch_err(format!(
                    "rope scaling {what} {v} is not a finite number above 0"
                )))
            }
        };
        match self {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor || original_max_positions == 0 {
                    return Err(arch_err(format!(
                        "llama3 rope scaling needs high_freq_factor {high_freq_factor} above \
                         low_freq_factor {low_freq_factor} and original_max_position_embeddings \
                         {original_max_positions} above 0"
                    )));
                }
                Ok(())
            }
        }
    }

    /// The scaled inverse frequency `f` (as transformers' `rope_type` of the same name).
    pub fn apply(self, f: f64) -> f64 {
        match self {
            RopeScaling::None => f,
            RopeScaling::Linear { factor } => f / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => {
                let old = original_max_positions as f64;
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < old / high_freq_factor {
                    f
                } else if wavelen > old / low_freq_factor {
                    f / factor
                } else {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            }
        }
    }
}
