//! `Gpt`: token and position embeddings, a stack of pre-LN blocks, a final LayerNorm and the
//! logits through the token embedding transposed (tied input/output embedding).

use oxiflow_collectives::DType;
use oxiflow_sbp::{Sbp, Shape};

use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::super::embedding::Embedding;
use super::super::init::{param_seed, Init, ParamPlacement};
use super::super::layer_norm::LayerNorm;
use super::super::param::{Module, Parameter};
use super::block::{Block, Pass, Recompute, LN_EPS};
use super::config::{GptConfig, GptLayout};

/// Standard deviation of the initial embeddings (GPT-2's).
const EMBEDDING_STD: f64 = 0.02;

fn table(name: &str, rows: usize, cfg: &GptConfig, at: &ParamPlacement) -> Result<Embedding> {
    let wname = format!("{name}.weight");
    let w = Init::Normal {
        seed: param_seed(cfg.seed, &wname),
        std: EMBEDDING_STD,
    }
    .build(Shape::new([rows, cfg.width]), cfg.dtype, at)?;
    Ok(Embedding {
        weight: Parameter::new(wname, &w),
    })
}

/// A GPT-2 style language model: `wte` `[vocab, C]` (also the output projection), `wpe`
/// `[seq_len, C]`, `h.<i>` blocks and `ln_f`.
#[derive(Clone, Debug)]
pub struct Gpt {
    pub cfg: GptConfig,
    pub layout: GptLayout,
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
        cfg.validate(layout)?;
        let blocks = (0..cfg.layers)
            .map(|i| Block::new(&format!("h.{i}"), cfg, layout))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt {
            wte: table("wte", cfg.vocab, cfg, &layout.token_embedding())?,
            wpe: table("wpe", cfg.seq_len, cfg, &layout.replicated())?,
            blocks,
            ln_f: LayerNorm::new("ln_f", cfg.width, LN_EPS, cfg.dtype, &layout.replicated())?,
            cfg: cfg.clone(),
            layout: layout.clone(),
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

    /// ids `[B, T]` (i64, T <= seq_len; global ids split over the data-parallel axis) ->
    /// logits `[B, T, vocab]`.
    pub fn forward(&self, ids: &Tensor, pass: Pass) -> Result<Tensor> {
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
        let layout = &self.layout;
        // One value of the tied table for both uses (gathered once if stored sharded).
        let wte = self.wte.weight.compute()?;
        let tok = Tensor::embedding(ids, &wte)?;
        let pos = self.wpe.weight.compute()?.narrow(0, 0, t)?;
        let x = pass.dropout(&self.cfg, "embedding", &tok.add(&pos)?)?;
        let stream = self.stream();
        let mut x = layout.relayout(&x, stream)?;
        for b in &self.blocks {
            x = b.forward(&x, &self.cfg, layout, stream, pass, self.recompute)?;
        }
        let x = layout.relayout(&self.ln_f.forward(&x)?, Sbp::B)?;
        x.matmul_t(&wte, false, true)
    }

    /// Mean next-token cross-entropy of ids `[B, T]` predicting targets `[B, T]` (a 0-d tensor).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, pass: Pass) -> Result<Tensor> {
        let logits = self.forward(ids, pass)?;
        let (b, t, v) = (
            logits.shape().dim(0),
            logits.shape().dim(1),
            logits.shape().dim(2),
        );
        if targets.shape() != ids.shape() {
            return Err(TensorError::Shape {
                op: "Gpt::loss",
                shapes: format!("{}, {}", ids.shape(), targets.shape()),
                sbps: format!("{:?}, {:?}", ids.nd_sbp(), targets.nd_sbp()),
                detail: "targets must have the ids' shape".into(),
            });
        }
        logits
            .reshape([b * t, v])?
            .cross_entropy(&targets.reshape([b * t])?)?
            .mean_all()
    }
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
