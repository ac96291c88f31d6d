//! `Gpt`: token and position embeddings, a stack of pre-LN blocks, a final LayerNorm and the
//! logits through the token embedding transposed (tied input/output embedding); its pieces
//! (`embed`, `run_chunk`, `head`) are what pipeline stages run.

use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::{NdSbp, Sbp, Shape};

use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::super::embedding::Embedding;
use super::super::init::{param_seed, Init, ParamPlacement};
use super::super::layer_norm::LayerNorm;
use super::super::param::{Module, Parameter};
use super::block::{Block, Recompute, LN_EPS};
use super::config::{GptConfig, GptLayout};
use super::stages::StageSplit;
use crate::nn::Pass;

/// Standard deviation of the initial embeddings (GPT-2's).
const EMBEDDING_STD: f64 = 0.02;

/// The parameter name of the token table (`wte`, tied to the output projection).
pub const TOKEN_TABLE: &str = "wte.weight";

/// An embedding table `wname` of `rows` rows, its initial values keyed by the name and each
/// element's global index (so the first rows of a padded table are the unpadded one's).
fn table(wname: &str, rows: usize, cfg: &GptConfig, at: &ParamPlacement) -> Result<Embedding> {
    let w = Init::Normal {
        seed: param_seed(cfg.seed, wname),
        std: EMBEDDING_STD,
    }
    .build(Shape::new([rows, cfg.width]), cfg.dtype, at)?;
    Ok(Embedding {
        weight: Parameter::new(wname, &w),
    })
}

/// A GPT-2 style language model: `wte` `[table_rows, C]` (also the output projection; the
/// vocabulary padded to an aligned size, see `GptConfig::vocab_multiple`), `wpe`
/// `[seq_len, C]`, `h.<i>` blocks and `ln_f`. Under a pipeline split (`split`) the blocks
/// live on their stages' layouts, the embeddings on the first stage and `ln_f` on the last.
#[derive(Clone, Debug)]
pub struct Gpt {
    pub cfg: GptConfig,
    /// The layout of the first stage (the whole model when not split).
    pub layout: GptLayout,
    pub split: StageSplit,
    pub wte: Embedding,
    pub wpe: Embedding,
    pub blocks: Vec<Block>,
    pub ln_f: LayerNorm,
    /// What the blocks keep for the backward pass (a memory/compute trade, not a model change).
    pub recompute: Recompute,
}

impl Gpt {
    /// A model of `cfg` laid out as `layout` (checked by `GptConfig::validate`). Initial
    /// values depend on the seed and parameter names only, never on the layout.
    pub fn new(cfg: &GptConfig, layout: &GptLayout) -> Result<Gpt> {
        Gpt::new_split(cfg, StageSplit::single(cfg.layers, layout))
    }

    /// A model of `cfg` split into pipeline stages as `split` says (every stage's layout is
    /// checked by `GptConfig::validate`; `split` must cover `cfg.layers` blocks).
    pub fn new_split(cfg: &GptConfig, split: StageSplit) -> Result<Gpt> {
        for s in 0..split.stages() {
            cfg.validate(split.layout(s))?;
        }
        let covered = split.blocks(split.chunks().saturating_sub(1)).end;
        if covered != cfg.layers {
            return Err(TensorError::Shape {
                op: "Gpt::new_split",
                shapes: "-".into(),
                sbps: "-".into(),
                detail: format!(
                    "the split covers {covered} blocks but the model has {}",
                    cfg.layers
                ),
            });
        }
        let first = split.first().clone();
        let blocks = (0..cfg.layers)
            .map(|i| Block::new(&format!("h.{i}"), cfg, split.block_layout(i)))
            .collect::<Result<Vec<_>>>()?;
        let last = split.last();
        Ok(Gpt {
            wte: table(TOKEN_TABLE, cfg.table_rows(), cfg, &first.token_embedding())?,
            wpe: table("wpe.weight", cfg.seq_len, cfg, &first.replicated())?,
            blocks,
            ln_f: LayerNorm::new("ln_f", cfg.width, LN_EPS, cfg.dtype, &last.replicated())?,
            cfg: cfg.clone(),
            layout: first,
            split,
            recompute: Recompute::None,
        })
    }

    /// The layout of the residual stream on the tensor-parallel axis.
    fn stream(&self) -> Sbp {
        if self.cfg.sequence_parallel {
            Sbp::S(1)
        } else {
            Sbp::B
        }
    }

    /// Where the residual stream entering and leaving virtual stage `g` lives: the stage's
    /// placement and the activations' nd-SBP there (None when local).
    pub fn stream_layout(&self, g: usize) -> Option<(Placement, NdSbp)> {
        let l = self.split.chunk_layout(g);
        Some((l.placement()?.clone(), l.activation_sbp(self.stream())?))
    }

    /// Where the tied table is computed with: the first stage's placement and the table's
    /// compute nd-SBP (None when local).
    pub fn tied_layout(&self) -> Option<(Placement, NdSbp)> {
        let v = self.wte.weight.value();
        let nd = self
            .wte
            .weight
            .compute_layout()
            .or_else(|| v.nd_sbp().cloned())?;
        Some((v.placement()?.clone(), nd))
    }

    /// ids `[B, T]` (i64 below `vocab`, T <= seq_len; global ids split over the data-parallel
    /// axis, on the first stage) -> the residual stream entering the blocks, through the table
    /// `wte` (the tied table's compute value; an id in its padding, `vocab..table_rows`, reads
    /// a padded row, one at or beyond `table_rows` is out of range).
    pub fn embed(&self, ids: &Tensor, wte: &Tensor, pass: Pass) -> Result<Tensor> {
        let t = match ids.shape().dims() {
            [_, t] if (1..=self.cfg.seq_len).contains(t) && ids.dtype() == DType::I64 => *t,
            _ => {
                return Err(TensorError::Shape {
                    op: "Gpt::forward",
                    shapes: ids.shape().to_string(),
                    sbps: format!("{:?}", ids.nd_sbp()),
                    detail: format!(
                        "ids must be i64 [batch, t] with 1 <= t <= seq_len {}, got {}",
                        self.cfg.seq_len,
                        ids.dtype()
                    ),
                })
            }
        };
        let tok = Tensor::embedding(ids, wte)?;
        let pos = self.wpe.weight.compute()?.narrow(0, 0, t)?;
        let x = pass.dropout(&self.cfg, "embedding", &tok.add(&pos)?)?;
        self.layout.relayout(&x, self.stream())
    }

    /// The blocks of virtual stage `g` on the residual stream `x` (on that stage's layout).
    pub fn run_chunk(&self, g: usize, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let layout = self.split.chunk_layout(g);
        let stream = self.stream();
        let mut x = x.clone();
        let blocks = self.split.blocks(g);
        let last_chunk = g + 1 == self.split.chunks();
        for i in blocks.clone() {
            // Parameters stored sharded: the next block's gathers (of this chunk; the final
            // norm's after the last block) are issued before this block computes, so they
            // overlap it where collectives run asynchronously.
            if i + 1 < blocks.end {
                self.blocks[i + 1].prefetch()?;
            } else if last_chunk {
                self.ln_f.prefetch()?;
            }
            let b = &self.blocks[i];
            x = b.forward(&x, &self.cfg, layout, stream, pass, self.recompute)?;
        }
        Ok(x)
    }

    /// The residual stream after the last block -> logits `[B, T, table_rows]` through the
    /// tied table `wte` (on the last stage's placement; the columns from `vocab` on are the
    /// padding's).
    pub fn head(&self, x: &Tensor, wte: &Tensor) -> Result<Tensor> {
        self.head_input(x)?.matmul_t(wte, false, true)
    }

    /// The final norm of the residual stream, whole on the last stage's tensor-parallel axis:
    /// what the tied table multiplies.
    fn head_input(&self, x: &Tensor) -> Result<Tensor> {
        self.split.last().relayout(&self.ln_f.forward(x)?, Sbp::B)
    }

    /// Mean next-token cross-entropy of the residual stream after the last block `x`
    /// `[B, T, C]` against targets `[B, T]` through the tied table `wte`: the head's product
    /// and the classifier as one op where a gradient is wanted
    /// ([`Tensor::linear_classifier_loss_sum`]), so the logits are never kept; equal to
    /// [`Gpt::loss_of`] of [`Gpt::head`].
    pub fn head_loss(&self, x: &Tensor, wte: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let h = self.head_input(x)?;
        check_targets(&h, targets)?;
        let (rows, c) = match h.shape().dims() {
            [b, t, c] => (b * t, *c),
            _ => {
                return Err(TensorError::Shape {
                    op: "Gpt::head_loss",
                    shapes: h.shape().to_string(),
                    sbps: format!("{:?}", h.nd_sbp()),
                    detail: "the residual stream must be [B, T, C]".into(),
                })
            }
        };
        let (h, targets) = (h.reshape([rows, c])?, targets.reshape([rows])?);
        h.linear_classifier_loss_sum(wte, &targets, self.cfg.vocab)?
            .mul_scalar(1.0 / rows.max(1) as f64)
    }

    /// ids `[B, T]` (i64, T <= seq_len; global ids split over the data-parallel axis, on the
    /// first stage) -> logits `[B, T, table_rows]` (on the last stage). Between pipeline stages the
    /// stream moves with `to_global`, and the tied table goes to the last stage the same way.
    pub fn forward(&self, ids: &Tensor, pass: Pass) -> Result<Tensor> {
        let (x, wte) = self.stream_out(ids, pass)?;
        self.head(&x, &wte)
    }

    /// ids -> the residual stream after the last block and the tied table, both on the last
    /// stage.
    fn stream_out(&self, ids: &Tensor, pass: Pass) -> Result<(Tensor, Tensor)> {
        // One value of the tied table for both uses (gathered once if stored sharded).
        let wte = self.wte.weight.compute()?;
        let mut x = self.embed(ids, &wte, pass)?;
        for g in 0..self.split.chunks() {
            if g > 0 && self.split.stage_of(g) != self.split.stage_of(g - 1) {
                if let Some((p, nd)) = self.stream_layout(g) {
                    x = x.to_global(&p, nd)?;
                }
            }
            x = self.run_chunk(g, &x, pass)?;
        }
        let wte = match (self.split.stages(), self.split.last().placement()) {
            (2.., Some(last)) => {
                let nd = wte.nd_sbp().cloned().unwrap_or_else(|| NdSbp::broadcast(2));
                wte.to_global(last, nd)?
            }
            _ => wte,
        };
        Ok((x, wte))
    }

    /// Mean next-token cross-entropy of `logits` `[B, T, table_rows]` against targets `[B, T]`
    /// over the first `vocab` classes (the padding is outside the softmax and gets no
    /// gradient).
    pub fn loss_of(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, t, v) = (
            logits.shape().dim(0),
            logits.shape().dim(1),
            logits.shape().dim(2),
        );
        check_targets(logits, targets)?;
        let (logits, targets) = (logits.reshape([b * t, v])?, targets.reshape([b * t])?);
        // The loss is in the logits' compute dtype (f32 for bf16), over `vocab` classes; one tensor of
        // the logits' size and dtype stays for the backward: classes whole take the fused
        // classifier (which keeps the logits' gradient), classes split over several ranks the
        // vocabulary-parallel cross-entropy (which keeps the logits).
        logits
            .classifier_loss_padded(&targets, self.cfg.vocab)?
            .mean_all()
    }

    /// Mean next-token cross-entropy of ids `[B, T]` predicting targets `[B, T]` (a 0-d tensor).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, pass: Pass) -> Result<Tensor> {
        if targets.shape() != ids.shape() {
            return Err(TensorError::Shape {
                op: "Gpt::loss",
                shapes: format!("{}, {}", ids.shape(), targets.shape()),
                sbps: format!("{:?}, {:?}", ids.nd_sbp(), targets.nd_sbp()),
                detail: "targets must have the ids' shape".into(),
            });
        }
        let (x, wte) = self.stream_out(ids, pass)?;
        self.head_loss(&x, &wte, targets)
    }
}

/// Targets `[B, T]` for a head output `[B, T, ..]`, else a shape error of `Gpt::loss`.
fn check_targets(out: &Tensor, targets: &Tensor) -> Result<()> {
    if out.ndim() >= 2 && targets.shape().dims() == &out.shape().dims()[..2] {
        return Ok(());
    }
    Err(TensorError::Shape {
        op: "Gpt::loss",
        shapes: format!("{}, {}", out.shape(), targets.shape()),
        sbps: format!("{:?}, {:?}", out.nd_sbp(), targets.nd_sbp()),
        detail: "targets must have the ids' shape".into(),
    })
}

impl Module for Gpt {
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = self.wte.parameters();
        v.extend(self.wpe.parameters());
        for b in &self.blocks {
            v.extend(b.parameters());
        }
        v.extend(self.ln_f.parameters());
        v
    }
}
