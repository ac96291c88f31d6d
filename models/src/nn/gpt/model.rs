//! `Gpt`: a decoder of the GPT family (GPT-2, Llama, Qwen2, Mistral: `Arch`): token
//! embeddings (and learned positions), a stack of pre-norm blocks, a final norm and the logits
//! through the token table transposed (tied) or an output table of its own; its pieces
//! (`embed`, `run_chunk`, `head`) are what pipeline stages run.

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_ops::classifier::classifier_loss_padded;
use oxiflow_ops::context_parallel::SeqOrder;
use oxiflow_ops::linear_classifier::linear_classifier_loss_sum_at;
use oxiflow_placement::Placement;
use oxiflow_sbp::{NdSbp, Sbp, Shape};

use crate::shape_error::{pair_shape_err, shape_err};
use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::super::embedding::Embedding;
use super::super::init::{param_seed, Init, ParamPlacement};
use super::super::param::{Module, Parameter};
use super::arch::{Arch, MlpKind, NormKind, Positions};
use super::block::{Block, Recompute};
use super::config::{GptConfig, GptLayout};
use super::moe::RouterLog;
use super::norm::Norm;
use super::stages::StageSplit;
use crate::nn::Pass;

/// Standard deviation of the initial embeddings (GPT-2's).
const EMBEDDING_STD: f64 = 0.02;

/// The parameter name of the token table (`wte`, tied to the output projection).
pub const TOKEN_TABLE: &str = "wte.weight";
/// The parameter name of an untied output table.
pub const HEAD_TABLE: &str = "lm_head.weight";

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

/// A decoder language model: `wte` `[table_rows, C]` (the vocabulary padded to an aligned
/// size, see `GptConfig::vocab_multiple`; also the output projection when tied), `wpe`
/// `[seq_len, C]` (learned positions only), `h.<i>` blocks, `ln_f` and, untied, `lm_head`
/// `[table_rows, C]`. Under a pipeline split (`split`) the blocks live on their stages'
/// layouts, the embeddings on the first stage, `ln_f` and `lm_head` on the last.
#[derive(Clone, Debug)]
pub struct Gpt {
    pub cfg: GptConfig,
    pub arch: Arch,
    /// The layout of the first stage (the whole model when not split).
    pub layout: GptLayout,
    pub split: StageSplit,
    pub wte: Embedding,
    pub wpe: Option<Embedding>,
    pub blocks: Vec<Block>,
    pub ln_f: Norm,
    pub lm_head: Option<Embedding>,
    /// What the blocks keep for the backward pass (a memory/compute trade, not a model change).
    pub recompute: Recompute,
    /// The rows of `wpe` a window of `seq_len` tokens reads in the layout's token order, made
    /// with the model where that order is not the natural one (so a step, a compiled one
    /// included, makes no tensor from host data).
    window_rows: Option<Tensor>,
}

impl Gpt {
    /// A GPT-2 (`Arch::gpt2`) of `cfg` laid out as `layout` (checked by
    /// `GptConfig::validate`). Initial values depend on the seed and parameter names only,
    /// never on the layout.
    pub fn new(cfg: &GptConfig, layout: &GptLayout) -> Result<Gpt> {
        Gpt::new_split(cfg, StageSplit::single(cfg.layers, layout))
    }

    /// A GPT-2 of `cfg` split into pipeline stages as `split` says (every stage's layout is
    /// checked by `GptConfig::validate`; `split` must cover `cfg.layers` blocks).
    pub fn new_split(cfg: &GptConfig, split: StageSplit) -> Result<Gpt> {
        Gpt::with_arch(cfg, &Arch::gpt2(), split)
    }

    /// A decoder of architecture `arch` and sizes `cfg`, split as `split` says (every stage's
    /// layout is checked by `GptConfig::validate` and `Arch::validate`).
    pub fn with_arch(cfg: &GptConfig, arch: &Arch, split: StageSplit) -> Result<Gpt> {
        for s in 0..split.stages() {
            cfg.validate(split.layout(s))?;
            arch.validate(cfg, split.layout(s))?;
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
            .map(|i| Block::new(&format!("h.{i}"), cfg, arch, split.block_layout(i)))
            .collect::<Result<Vec<_>>>()?;
        let last = split.last();
        let wpe = match arch.positions {
            Positions::Learned => Some(table("wpe.weight", cfg.seq_len, cfg, &first.replicated())?),
            Positions::Rotary { .. } => None,
        };
        let lm_head = match arch.tie_embeddings {
            true => None,
            false => Some(table(
                HEAD_TABLE,
                cfg.table_rows(),
                cfg,
                &last.token_embedding(),
            )?),
        };
        let order = first.seq_order();
        let window_rows = match (&wpe, order) {
            (Some(w), o) if o != SeqOrder::Natural => {
                Some(order_rows(&w.weight.value(), o, 0, cfg.seq_len)?)
            }
            _ => None,
        };
        Ok(Gpt {
            wte: table(TOKEN_TABLE, cfg.table_rows(), cfg, &first.token_embedding())?,
            wpe,
            blocks,
            ln_f: Norm::new("ln_f", cfg, arch, &last.replicated())?,
            lm_head,
            cfg: cfg.clone(),
            arch: arch.clone(),
            layout: first,
            split,
            recompute: Recompute::None,
            window_rows,
        })
    }

    /// The names and global shapes of the parameters a decoder of `cfg` and `arch` has, in
    /// `parameters()` order, without building it: what a check against a checkpoint needs
    /// before any tensor exists.
    pub fn parameter_shapes(cfg: &GptConfig, arch: &Arch) -> Vec<(String, Vec<usize>)> {
        let (c, hd, rows) = (cfg.width, cfg.head_dim(), cfg.table_rows());
        let (q, kv, f) = (cfg.heads * hd, arch.kv(cfg) * hd, arch.ffn(cfg));
        let mut v: Vec<(String, Vec<usize>)> = vec![(TOKEN_TABLE.into(), vec![rows, c])];
        if arch.positions == Positions::Learned {
            v.push(("wpe.weight".into(), vec![cfg.seq_len, c]));
        }
        let norm = |v: &mut Vec<(String, Vec<usize>)>, name: &str| {
            v.push((format!("{name}.weight"), vec![c]));
            if arch.norm == NormKind::LayerNorm {
                v.push((format!("{name}.bias"), vec![c]));
            }
        };
        let linear = |v: &mut Vec<(String, Vec<usize>)>, name: String, i: usize, o: usize, b| {
            v.push((format!("{name}.weight"), vec![i, o]));
            if b {
                v.push((format!("{name}.bias"), vec![o]));
            }
        };
        for l in 0..cfg.layers {
            let h = format!("h.{l}");
            norm(&mut v, &format!("{h}.ln1"));
            for (n, out) in [("q", q), ("k", kv), ("v", kv)] {
                linear(&mut v, format!("{h}.attn.{n}"), c, out, arch.qkv_bias);
            }
            linear(&mut v, format!("{h}.attn.proj"), q, c, arch.out_bias);
            norm(&mut v, &format!("{h}.ln2"));
            if let Some(moe) = &arch.moe {
                v.extend(moe.parameter_shapes(&format!("{h}.mlp"), c));
                continue;
            }
            let (up, down) = match arch.mlp {
                MlpKind::Gelu => ("fc", "proj"),
                MlpKind::SwiGlu => {
                    linear(&mut v, format!("{h}.mlp.gate"), c, f, arch.mlp_bias);
                    ("up", "down")
                }
            };
            linear(&mut v, format!("{h}.mlp.{up}"), c, f, arch.mlp_bias);
            linear(&mut v, format!("{h}.mlp.{down}"), f, c, arch.mlp_bias);
        }
        norm(&mut v, "ln_f");
        if !arch.tie_embeddings {
            v.push((HEAD_TABLE.into(), vec![rows, c]));
        }
        v
    }

    /// The layout of the residual stream on the tensor-parallel axis.
    pub(super) fn stream(&self) -> Sbp {
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
    /// compute nd-SBP (None when local or untied).
    pub fn tied_layout(&self) -> Option<(Placement, NdSbp)> {
        if self.lm_head.is_some() {
            return None;
        }
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
        self.embed_at(ids, wte, pass, 0)
    }

    /// [`Gpt::embed`] of ids at positions `pos0..pos0 + T` (`pos0 + T <= seq_len`).
    pub fn embed_at(&self, ids: &Tensor, wte: &Tensor, pass: Pass, pos0: usize) -> Result<Tensor> {
        let room = self.cfg.seq_len.saturating_sub(pos0);
        let t = match ids.shape().dims() {
            [_, t] if (1..=room).contains(t) && ids.dtype() == DType::I64 => *t,
            _ => {
                return Err(shape_err(
                    "Gpt::forward",
                    ids,
                    format!(
                        "ids must be i64 [batch, t] with 1 <= t <= seq_len {} - {pos0} earlier \
                         positions, got {}",
                        self.cfg.seq_len,
                        ids.dtype()
                    ),
                ))
            }
        };
        let tok = Tensor::embedding(ids, wte)?;
        let x = match &self.wpe {
            Some(wpe) => tok.add(&self.position_rows(&wpe.weight.compute()?, pos0, t)?)?,
            None => tok,
        };
        let x = pass.dropout(&self.cfg, "embedding", &x)?;
        self.layout.relayout(&x, self.stream())
    }

    /// Rows `pos0..pos0 + t` of the learned position table `wpe`, in the layout's token order.
    fn position_rows(&self, wpe: &Tensor, pos0: usize, t: usize) -> Result<Tensor> {
        let order = self.layout.seq_order();
        if order == SeqOrder::Natural {
            return wpe.narrow(0, pos0, t);
        }
        let made;
        let rows = match &self.window_rows {
            Some(r) if pos0 == 0 && r.shape().dims() == [t] && r.placement() == wpe.placement() => {
                r
            }
            _ => {
                made = order_rows(wpe, order, pos0, t)?;
                &made
            }
        };
        wpe.index_select(0, rows)
    }

    /// The blocks of virtual stage `g` on the residual stream `x` (on that stage's layout).
    pub fn run_chunk(&self, g: usize, x: &Tensor, pass: Pass) -> Result<Tensor> {
        self.run_chunk_routed(g, x, pass, &mut RouterLog::default())
    }

    /// [`Gpt::run_chunk`], adding the routing statistics of mixture-of-experts blocks to `log`.
    pub fn run_chunk_routed(
        &self,
        g: usize,
        x: &Tensor,
        pass: Pass,
        log: &mut RouterLog,
    ) -> Result<Tensor> {
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
            x = b.forward_routed(&x, &self.cfg, layout, stream, pass, self.recompute, log)?;
        }
        Ok(x)
    }

    /// The residual stream after the last block -> logits `[B, T, table_rows]` through the
    /// output table `wte` (the tied token table or `lm_head`, on the last stage's placement;
    /// the columns from `vocab` on are the padding's).
    pub fn head(&self, x: &Tensor, wte: &Tensor) -> Result<Tensor> {
        let mp = self.matmul_precision();
        self.head_input(x)?.matmul_t_at(wte, (false, true), mp)
    }

    /// The precision of the head's f32 products: the output table's, from the model's
    /// precision policy ([`Module::set_precision`]).
    pub fn matmul_precision(&self) -> MatmulPrecision {
        self.lm_head
            .as_ref()
            .map_or(&self.wte.weight, |h| &h.weight)
            .matmul_precision()
    }

    /// The output table's value on the last stage: `lm_head`'s, or the tied token table's when
    /// `tied` is None (moved there from the first stage under a pipeline split).
    pub fn head_table(&self, tied: Option<&Tensor>) -> Result<Tensor> {
        match (&self.lm_head, tied) {
            (Some(h), _) => h.weight.compute(),
            (None, Some(w)) => Ok(w.clone()),
            (None, None) => self.to_last_stage(self.wte.weight.compute()?),
        }
    }

    /// `wte` (on the first stage) on the last stage's placement, in its own nd-SBP.
    pub(super) fn to_last_stage(&self, wte: Tensor) -> Result<Tensor> {
        match (self.split.stages(), self.split.last().placement()) {
            (2.., Some(last)) => {
                let nd = wte.nd_sbp().cloned().unwrap_or_else(|| NdSbp::broadcast(2));
                wte.to_global(last, nd)
            }
            _ => Ok(wte),
        }
    }

    /// The final norm of the residual stream, whole on the last stage's tensor-parallel axis:
    /// what the tied table multiplies.
    pub(super) fn head_input(&self, x: &Tensor) -> Result<Tensor> {
        self.split.last().relayout(&self.ln_f.forward(x)?, Sbp::B)
    }

    /// Mean next-token cross-entropy of the residual stream after the last block `x`
    /// `[B, T, C]` against targets `[B, T]` through the tied table `wte`: the head's product
    /// and the classifier as one op where a gradient is wanted
    /// ([`linear_classifier_loss_sum_at`]), so the logits are never kept; equal to
    /// [`Gpt::loss_of`] of [`Gpt::head`].
    pub fn head_loss(&self, x: &Tensor, wte: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (sum, rows) = self.head_loss_sum(x, wte, targets)?;
        sum.mul_scalar(1.0 / rows.max(1) as f64)
    }

    /// The summed next-token cross-entropy of [`Gpt::head_loss`] (a 0-d tensor) and the
    /// number of tokens it sums over.
    pub fn head_loss_sum(
        &self,
        x: &Tensor,
        wte: &Tensor,
        targets: &Tensor,
    ) -> Result<(Tensor, usize)> {
        let h = self.head_input(x)?;
        check_targets(&h, targets)?;
        let (rows, c) = match h.shape().dims() {
            [b, t, c] => (b * t, *c),
            _ => {
                return Err(shape_err(
                    "Gpt::head_loss",
                    &h,
                    "the residual stream must be [B, T, C]".into(),
                ))
            }
        };
        let (h, targets) = (h.reshape([rows, c])?, targets.reshape([rows])?);
        let mp = self.matmul_precision();
        let sum = linear_classifier_loss_sum_at(&h, wte, &targets, self.cfg.vocab, mp)?;
        Ok((sum, rows))
    }

    /// ids `[B, T]` (i64, T <= seq_len; global ids split over the data-parallel axis, on the
    /// first stage) -> logits `[B, T, table_rows]` (on the last stage). Between pipeline stages the
    /// stream moves with `to_global`, and the tied table goes to the last stage the same way.
    pub fn forward(&self, ids: &Tensor, pass: Pass) -> Result<Tensor> {
        let (x, wte) = self.stream_out(ids, pass, &mut RouterLog::default())?;
        self.head(&x, &wte)
    }

    /// ids -> the residual stream after the last block and the output table, both on the
    /// last stage; mixture-of-experts blocks add their routing statistics to `log`.
    fn stream_out(
        &self,
        ids: &Tensor,
        pass: Pass,
        log: &mut RouterLog,
    ) -> Result<(Tensor, Tensor)> {
        // One value of the token table for both uses when tied (gathered once if stored
        // sharded).
        let wte = self.wte.weight.compute()?;
        let mut x = self.embed(ids, &wte, pass)?;
        for g in 0..self.split.chunks() {
            if g > 0 && self.split.stage_of(g) != self.split.stage_of(g - 1) {
                if let Some((p, nd)) = self.stream_layout(g) {
                    x = x.to_global(&p, nd)?;
                }
            }
            x = self.run_chunk_routed(g, &x, pass, log)?;
        }
        let table = match &self.lm_head {
            Some(h) => h.weight.compute()?,
            None => self.to_last_stage(wte)?,
        };
        Ok((x, table))
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
        classifier_loss_padded(&logits, &targets, self.cfg.vocab)?.mean_all()
    }

    /// Mean next-token cross-entropy of ids `[B, T]` predicting targets `[B, T]` (a 0-d
    /// tensor), plus the router's auxiliary loss times its coefficient in training passes of
    /// a mixture of experts ([`Gpt::loss_parts`]).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, pass: Pass) -> Result<Tensor> {
        let (ce, aux) = self.loss_parts(ids, targets, pass)?;
        match (aux, &self.arch.moe) {
            (Some(aux), Some(moe)) if pass != Pass::Eval && moe.aux_loss_coef > 0.0 => {
                ce.add(&aux.mul_scalar(moe.aux_loss_coef)?.cast(ce.dtype())?)
            }
            _ => Ok(ce),
        }
    }

    /// The mean next-token cross-entropy of ids `[B, T]` predicting targets `[B, T]` and, for
    /// a mixture of experts, the router's load-balancing loss over every block (without its
    /// coefficient; see [`RouterLog::aux_loss`]).
    pub fn loss_parts(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        pass: Pass,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let mut log = RouterLog::default();
        let (x, wte) = self.stream_out_for("Gpt::loss", ids, targets, pass, &mut log)?;
        Ok((self.head_loss(&x, &wte, targets)?, log.aux_loss()?))
    }

    /// The summed next-token cross-entropy of ids `[B, T]` predicting targets `[B, T]` (a 0-d
    /// tensor on the last stage) and the number of tokens it sums over: what an evaluation
    /// over batches of any size adds up.
    pub fn loss_sum(&self, ids: &Tensor, targets: &Tensor, pass: Pass) -> Result<(Tensor, usize)> {
        self.loss_sum_routed(ids, targets, pass, &mut RouterLog::default())
    }

    /// [`Gpt::loss_sum`], adding the routing statistics of mixture-of-experts blocks to `log`
    /// (an evaluation's load-balancing loss over all its batches).
    pub fn loss_sum_routed(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        pass: Pass,
        log: &mut RouterLog,
    ) -> Result<(Tensor, usize)> {
        let (x, table) = self.stream_out_for("Gpt::loss_sum", ids, targets, pass, log)?;
        self.head_loss_sum(&x, &table, targets)
    }

    /// [`Gpt::stream_out`] of `ids` once `targets` have their shape (else an error of `op`).
    fn stream_out_for(
        &self,
        op: &'static str,
        ids: &Tensor,
        targets: &Tensor,
        pass: Pass,
        log: &mut RouterLog,
    ) -> Result<(Tensor, Tensor)> {
        if targets.shape() != ids.shape() {
            return Err(pair_shape_err(
                op,
                ids,
                targets,
                "targets must have the ids' shape".into(),
            ));
        }
        self.stream_out(ids, pass, log)
    }
}

/// Targets `[B, T]` for a head output `[B, T, ..]`, else a shape error of `Gpt::loss`.
fn check_targets(out: &Tensor, targets: &Tensor) -> Result<()> {
    if out.ndim() >= 2 && targets.shape().dims() == &out.shape().dims()[..2] {
        return Ok(());
    }
    Err(pair_shape_err(
        "Gpt::loss",
        out,
        targets,
        "targets must have the ids' shape".into(),
    ))
}

impl Module for Gpt {
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = self.wte.parameters();
        v.extend(self.wpe.iter().flat_map(Embedding::parameters));
        for b in &self.blocks {
            v.extend(b.parameters());
        }
        v.extend(self.ln_f.parameters());
        v.extend(self.lm_head.iter().flat_map(Embedding::parameters));
        v
    }
}

/// The indices of positions `pos0..pos0 + t` held in `order`, broadcast on `like`'s placement.
fn order_rows(like: &Tensor, order: SeqOrder, pos0: usize, t: usize) -> Result<Tensor> {
    let rows: Vec<i64> = order
        .positions(t)
        .into_iter()
        .map(|p| (pos0 + p) as i64)
        .collect();
    let rows = Tensor::from_vec(rows, [t])?;
    match like.placement() {
        Some(p) => rows.to_global(p, NdSbp::broadcast(p.ndim())),
        None => Ok(rows),
    }
}
