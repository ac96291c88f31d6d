//! The sizes of a GPT and where its tensors live: `GptConfig` (checked by `validate`) and
//! `GptLayout` (local, or a `[dp, tp]` or `[dp, tp, cp]` mesh with the activations' nd-SBPs on
//! it; a context-parallel axis splits the sequence in the load-balanced causal order).

use oxiflow_dtype::DType;
use oxiflow_ops::context_parallel::{CpAlgorithm, SeqOrder};
use oxiflow_placement::Placement;
use oxiflow_sbp::{NdSbp, Sbp};

use crate::{Result, TensorError};

use super::super::init::ParamPlacement;
use super::super::linear::{LinearOptions, Parallel};

/// The data-parallel mesh axis of a `GptLayout::Mesh`.
pub const DP_AXIS: usize = 0;
/// The tensor-parallel mesh axis of a `GptLayout::Mesh`.
pub const TP_AXIS: usize = 1;
/// The context-parallel mesh axis of a 3-d `GptLayout::Mesh` (the sequence split over it).
pub const CP_AXIS: usize = 2;
/// The multiple the programs (`train --vocab-multiple`, `gpt_bench`) round the token table's
/// rows up to by default: GPT-2's 50257 becomes nanoGPT's 50304, so the logits' product runs
/// on aligned widths. (`GptConfig::default()` pads nothing: a multiple of 1.)
pub const DEFAULT_VOCAB_MULTIPLE: usize = 64;

/// `vocab` rounded up to a multiple of `multiple`: the token table's rows (None for a multiple
/// of 0, or when the size overflows).
pub fn padded_vocab(vocab: usize, multiple: usize) -> Option<usize> {
    vocab.checked_next_multiple_of(multiple)
}

/// The sizes and options of a GPT-2 style model.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    /// Number of token ids: the classes of the loss and of generation.
    pub vocab: usize,
    /// The token table (`wte`, tied to the output) has `vocab` rounded up to a multiple of
    /// this many rows ([`GptConfig::table_rows`]; 1: exactly `vocab`). The padded rows are
    /// never looked up, their logits are outside the loss's softmax and generation, and their
    /// gradient is 0: the model computes the same function as an unpadded one.
    pub vocab_multiple: usize,
    /// Longest sequence (rows of the learned position table).
    pub seq_len: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Attention heads per block (`width` must be a multiple).
    pub heads: usize,
    /// Model width (embedding size).
    pub width: usize,
    /// Dropout probability after attention, MLP and embeddings (0: none).
    pub dropout: f64,
    /// Seed of the initial weights (and of dropout masks).
    pub seed: u64,
    pub dtype: DType,
    /// Sequence parallelism: between blocks the activations are split along the sequence on
    /// the tensor-parallel axis (needs a mesh).
    pub sequence_parallel: bool,
    /// How attention runs over a sequence split on a context-parallel axis.
    pub context_attention: CpAlgorithm,
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig {
            vocab: 256,
            vocab_multiple: 1,
            seq_len: 64,
            layers: 2,
            heads: 4,
            width: 64,
            dropout: 0.0,
            seed: 0,
            dtype: DType::F32,
            sequence_parallel: false,
            context_attention: CpAlgorithm::Ring,
        }
    }
}

fn config_err(detail: String) -> TensorError {
    TensorError::Shape {
        op: "GptConfig::validate",
        shapes: "-".into(),
        sbps: "-".into(),
        detail,
    }
}

impl GptConfig {
    /// Checks the sizes against each other and against `layout` (heads split over the
    /// tensor-parallel axis, sequence parallelism on a mesh).
    pub fn validate(&self, layout: &GptLayout) -> Result<()> {
        let sizes = [
            ("vocab", self.vocab),
            ("vocab_multiple", self.vocab_multiple),
            ("seq_len", self.seq_len),
            ("layers", self.layers),
            ("heads", self.heads),
            ("width", self.width),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(config_err(format!("{name} must be at least 1")));
        }
        if padded_vocab(self.vocab, self.vocab_multiple).is_none() {
            return Err(config_err(format!(
                "vocab {} rounded up to a multiple of vocab_multiple {} overflows",
                self.vocab, self.vocab_multiple
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(config_err(format!(
                "dropout {} is not in [0, 1)",
                self.dropout
            )));
        }
        if !self.width.is_multiple_of(self.heads) {
            return Err(config_err(format!(
                "width {} is not a multiple of heads {}",
                self.width, self.heads
            )));
        }
        if matches!(self.dtype, DType::I64) {
            return Err(config_err("dtype must be f32 or f64".into()));
        }
        match layout {
            GptLayout::Local if self.sequence_parallel => Err(config_err(
                "sequence parallelism needs a [dp, tp] mesh".into(),
            )),
            GptLayout::Local => Ok(()),
            GptLayout::Mesh(p) => {
                let tp = p.shape().get(TP_AXIS).copied().unwrap_or(0);
                if p.ndim() != 2 && p.ndim() != 3 {
                    return Err(config_err(format!(
                        "the mesh {p} must have the axes [dp, tp] or [dp, tp, cp]"
                    )));
                }
                let cp = layout.cp();
                if cp > 1 && self.seq_len < 2 * cp {
                    return Err(config_err(format!(
                        "seq_len {} is shorter than the 2 x {cp} load-balanced chunks of the \
                         context-parallel axis",
                        self.seq_len
                    )));
                }
                if cp > 1 && self.sequence_parallel {
                    return Err(config_err(
                        "sequence parallelism and a context-parallel axis both split the sequence; \
                         use one"
                            .into(),
                    ));
                }
                if !self.heads.is_multiple_of(tp) {
                    return Err(config_err(format!(
                        "heads {} must be divisible by the tensor-parallel degree {tp} (heads are split over the tp axis)",
                        self.heads
                    )));
                }
                Ok(())
            }
        }
    }

    /// Rows of the token table and width of the logits: `vocab` rounded up to a multiple of
    /// `vocab_multiple` (`vocab` itself for a multiple of 0 or a size that overflows, which
    /// `validate` refuses).
    pub fn table_rows(&self) -> usize {
        padded_vocab(self.vocab, self.vocab_multiple).unwrap_or(self.vocab)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.width / self.heads.max(1)
    }
}

/// Where the model's tensors live.
#[derive(Clone, Debug, PartialEq)]
pub enum GptLayout {
    /// Local tensors on this process.
    Local,
    /// Global tensors on a 2-d mesh `[dp, tp]`: the batch split on axis `DP_AXIS`, heads and
    /// MLP columns on `TP_AXIS`.
    Mesh(Placement),
}

impl GptLayout {
    /// The placement, if global.
    pub fn placement(&self) -> Option<&Placement> {
        match self {
            GptLayout::Local => None,
            GptLayout::Mesh(p) => Some(p),
        }
    }

    /// The degree of the tensor-parallel axis (1 when local).
    pub fn tp(&self) -> usize {
        self.placement()
            .and_then(|p| p.shape().get(TP_AXIS).copied())
            .unwrap_or(1)
    }

    /// The degree of the context-parallel axis (1 when local or on a 2-d mesh).
    pub fn cp(&self) -> usize {
        self.placement()
            .filter(|p| p.ndim() > CP_AXIS)
            .and_then(|p| p.shape().get(CP_AXIS).copied())
            .unwrap_or(1)
    }

    /// The order of the tokens along the sequence dim of the activations: load-balanced for
    /// the context-parallel ranks when there are several, else natural.
    pub fn seq_order(&self) -> SeqOrder {
        match self.cp() {
            1 => SeqOrder::Natural,
            ranks => SeqOrder::Balanced { ranks },
        }
    }

    /// Options of a linear layer of `cfg` with a bias, split as `parallel` on a mesh
    /// (replicated when local).
    pub fn linear(&self, cfg: &GptConfig, parallel: Parallel) -> LinearOptions {
        self.linear_biased(cfg, parallel, true)
    }

    /// Options of a linear layer of `cfg`, with a bias or not, split as `parallel` on a mesh
    /// (replicated when local).
    pub fn linear_biased(&self, cfg: &GptConfig, parallel: Parallel, bias: bool) -> LinearOptions {
        LinearOptions {
            bias,
            seed: cfg.seed,
            dtype: cfg.dtype,
            placement: self.placement().cloned(),
            parallel: match self {
                GptLayout::Local => Parallel::Replicated,
                GptLayout::Mesh(_) => parallel,
            },
        }
    }

    /// A parameter replicated on every rank.
    pub fn replicated(&self) -> ParamPlacement {
        self.param_at(Sbp::B)
    }

    /// The token-embedding table `[table_rows, width]`, also the output projection (tied): its SBP
    /// on the tensor-parallel axis: split along the vocabulary (`S(0)`, Megatron's
    /// vocabulary-parallel embedding), so the lookup gives a partial sum and the logits come out
    /// split along the vocabulary, which cross-entropy reduces without gathering them.
    pub fn token_embedding(&self) -> ParamPlacement {
        self.param_at(Sbp::S(0))
    }

    fn param_at(&self, tp: Sbp) -> ParamPlacement {
        match self {
            GptLayout::Local => ParamPlacement::Local,
            GptLayout::Mesh(p) => {
                let mut s = NdSbp::broadcast(p.ndim());
                s.set(TP_AXIS, tp);
                ParamPlacement::Global {
                    placement: p.clone(),
                    nd_sbp: s,
                }
            }
        }
    }

    /// nd-SBP of activations `[B, T, ..]` with the batch split over the data-parallel axis,
    /// on the tensor-parallel axis `tp` (B: whole; S(1): sequence parallel), and the sequence
    /// split over a context-parallel axis.
    pub fn activation_sbp(&self, tp: Sbp) -> Option<NdSbp> {
        self.placement().map(|p| {
            let mut axes = vec![Sbp::S(0), tp];
            if p.ndim() > CP_AXIS {
                axes.push(Sbp::S(1));
            }
            NdSbp::new(axes)
        })
    }

    /// Boxes `x [B, T, ..]` to the batch split on the data-parallel axis and `tp` on the
    /// tensor-parallel axis (no-op for local tensors).
    pub fn relayout(&self, x: &oxiflow_tensor::Tensor, tp: Sbp) -> Result<oxiflow_tensor::Tensor> {
        match (self.placement(), self.activation_sbp(tp)) {
            (Some(p), Some(s)) => x.to_global(p, s),
            _ => Ok(x.clone()),
        }
    }
}
