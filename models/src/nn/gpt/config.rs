//! The sizes of a GPT and where its tensors live: `GptConfig` (checked by `validate`) and
//! `GptLayout` (local, or a mesh of named axes with the activations' nd-SBPs on it, each axis's
//! SBP from its role: the batch, the heads, the sequence in the load-balanced causal order).

use oxiflow_dtype::DType;
use oxiflow_ops::context_parallel::{CpAlgorithm, SeqOrder};
use oxiflow_placement::{AxisRole, NamedMesh, Placement};
use oxiflow_sbp::{NdSbp, Sbp};

use crate::{Result, TensorError};

use super::super::init::ParamPlacement;
use super::super::linear::{LinearOptions, Parallel};

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
            GptLayout::Mesh(m) => {
                if self.sequence_parallel && m.axis(AxisRole::Heads).is_none() {
                    return Err(config_err(format!(
                        "sequence parallelism needs a tensor-parallel axis; the mesh {m} has none"
                    )));
                }
                if let Some(a) = m.axes().iter().find(|a| a.kind.splits(AxisRole::Stages)) {
                    return Err(config_err(format!(
                        "the mesh {m} of one stage has the pipeline axis {}",
                        a.name()
                    )));
                }
                let (tp, cp) = (layout.tp(), layout.cp());
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
    /// Global tensors on a mesh of named axes: the batch split over the axis with that role,
    /// heads and MLP columns over the tensor-parallel one, the sequence over a context-parallel
    /// one.
    Mesh(NamedMesh),
}

impl GptLayout {
    /// The named mesh, if global.
    pub fn mesh(&self) -> Option<&NamedMesh> {
        match self {
            GptLayout::Local => None,
            GptLayout::Mesh(m) => Some(m),
        }
    }

    /// The placement, if global.
    pub fn placement(&self) -> Option<&Placement> {
        self.mesh().map(NamedMesh::placement)
    }

    /// The size of the axis that splits `role` (1 when local or without such an axis).
    pub fn size(&self, role: AxisRole) -> usize {
        self.mesh().map_or(1, |m| m.size(role))
    }

    /// The degree of the tensor-parallel axis (1 when local or without one).
    pub fn tp(&self) -> usize {
        self.size(AxisRole::Heads)
    }

    /// The degree of the context-parallel axis (1 when local or without one).
    pub fn cp(&self) -> usize {
        self.size(AxisRole::Sequence)
    }

    /// A layer whose output columns (heads, MLP hidden units) are split over the
    /// tensor-parallel axis (replicated without one).
    pub fn column(&self) -> Parallel {
        self.heads_axis()
            .map_or(Parallel::Replicated, Parallel::Column)
    }

    /// A layer whose input rows are split over the tensor-parallel axis (replicated without
    /// one).
    pub fn row(&self) -> Parallel {
        self.heads_axis()
            .map_or(Parallel::Replicated, Parallel::Row)
    }

    fn heads_axis(&self) -> Option<usize> {
        self.mesh().and_then(|m| m.axis(AxisRole::Heads))
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
            GptLayout::Mesh(m) => ParamPlacement::Global {
                placement: m.placement().clone(),
                nd_sbp: NdSbp::new(m.axes().iter().map(|a| {
                    if a.kind.splits(AxisRole::Heads) {
                        tp
                    } else {
                        Sbp::B
                    }
                })),
            },
        }
    }

    /// nd-SBP of activations `[B, T, ..]`, per mesh axis by its role: the batch split over the
    /// data-parallel axis and an expert-parallel one (its ranks are data-parallel too), `tp` on
    /// the tensor-parallel axis (B: whole; S(1): sequence parallel), the sequence split over a
    /// context-parallel axis, whole on any other.
    pub fn activation_sbp(&self, tp: Sbp) -> Option<NdSbp> {
        self.mesh().map(|m| {
            NdSbp::new(m.axes().iter().map(|a| {
                let splits = |r| a.kind.splits(r);
                if splits(AxisRole::Batch) || splits(AxisRole::Experts) {
                    Sbp::S(0)
                } else if splits(AxisRole::Heads) {
                    tp
                } else if splits(AxisRole::Sequence) {
                    Sbp::S(1)
                } else {
                    Sbp::B
                }
            }))
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
