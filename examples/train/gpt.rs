//! GPT training for `train --model gpt`: a byte-level GPT on a text corpus, on a mesh
//! `[dp, tp]` (batch over dp, Megatron tensor parallelism and optionally sequence parallelism
//! over tp). The model's initial values and every batch depend only on the seed and the step,
//! so every layout trains the same function; checkpoints carry the step, which is the data
//! loader's position, and resume under any layout.

use std::path::{Path, PathBuf};

use oxiflow::checkpoint::{self, Metadata, SaveOptions};
use oxiflow::data::{ByteTokenizer, Corpus, WindowSampler};
use oxiflow::models::footprint::Footprint;
use oxiflow::nn::gpt::{Gpt, GptConfig, GptLayout, Pass, Recompute, DP_AXIS};
use oxiflow::nn::Module;
use oxiflow::optim::{AdamW, AdamWOptions, Optimizer, Zero};
use oxiflow::prelude::*;
use oxiflow::{no_grad, Context, Result};

use crate::classifier::mesh_placement;

/// Held-out windows scored by `heldout_loss` (batches of the training batch size).
pub const EVAL_BATCHES: u64 = 4;

/// Everything that defines a GPT training run.
#[derive(Clone, Debug)]
pub struct GptTrainConfig {
    /// Mesh `[dp, tp]` over ranks `0..dp*tp`.
    pub mesh: (usize, usize),
    pub model: GptConfig,
    /// Global batch (windows per step), a multiple of dp.
    pub batch_size: usize,
    pub lr: f64,
    /// A text or pre-tokenized file; None: the default corpus.
    pub data: Option<PathBuf>,
    pub device: DeviceType,
    /// ZeRO stage (0-3) over the data-parallel axis.
    pub zero: u8,
    /// What each block keeps for its backward pass.
    pub recompute: Recompute,
}

/// A training run: model, optimizer, corpus, samplers and step counter.
pub struct GptRun {
    pub model: Gpt,
    pub optimizer: AdamW,
    pub corpus: Corpus,
    train_windows: WindowSampler,
    heldout_windows: WindowSampler,
    placement: Placement,
    /// This rank's rows of every batch.
    rows: std::ops::Range<usize>,
    pub step: u64,
    pub cfg: GptTrainConfig,
    /// Host and device peak bytes during the last step's forward and backward (host: when the
    /// counting allocator is installed).
    pub step_peak: (Option<usize>, usize),
    /// Parameters, gradients and optimizer state after the last step's backward pass.
    pub step_footprint: Footprint,
}

fn program_err(op: &'static str, detail: String) -> TensorError {
    TensorError::Kernel { op, detail }
}

fn first(op: &'static str, t: &Tensor) -> Result<f64> {
    let v = t.cast(DType::F64)?.to_vec::<f64>()?;
    v.first()
        .copied()
        .ok_or_else(|| program_err(op, "empty result".into()))
}

impl GptRun {
    /// Builds the model, optimizer and data (needs an installed context).
    pub fn new(cfg: &GptTrainConfig) -> Result<GptRun> {
        let (dp, tp) = cfg.mesh;
        if !cfg.batch_size.is_multiple_of(dp) {
            return Err(program_err(
                "GptRun::new",
                format!(
                    "--batch-size {} must be a multiple of --dp {dp}",
                    cfg.batch_size
                ),
            ));
        }
        let placement = mesh_placement(dp, tp)?.with_device(cfg.device);
        let rank = Context::current()
            .ok_or_else(|| program_err("GptRun::new", "no runtime context".into()))?
            .rank();
        let coord = placement.coord_of(rank).ok_or_else(|| {
            program_err(
                "GptRun::new",
                format!("rank {rank} is not in the mesh {placement}"),
            )
        })?;
        let per = cfg.batch_size / dp;
        let rows = coord[DP_AXIS] * per..(coord[DP_AXIS] + 1) * per;
        let corpus = match &cfg.data {
            Some(p) => Corpus::from_path(p),
            None => Ok(Corpus::default_corpus(cfg.model.seed)),
        }
        .map_err(|e| program_err("--data", e.to_string()))?;
        let mut model_cfg = cfg.model.clone();
        model_cfg.vocab = corpus.vocab();
        let sampler = |tokens: &[u16], seed: u64| {
            WindowSampler::new(tokens.len(), seed, cfg.batch_size, model_cfg.seq_len)
                .map_err(|e| program_err("GptRun::new", format!("{}: {e}", corpus.source)))
        };
        let train_windows = sampler(corpus.train(), model_cfg.seed)?;
        let heldout_windows = sampler(corpus.heldout(), !model_cfg.seed)?;
        let mut model = Gpt::new(&model_cfg, &GptLayout::Mesh(placement.clone()))?;
        model.recompute = cfg.recompute;
        let optimizer = AdamW::new(
            model.parameters(),
            AdamWOptions {
                lr: cfg.lr,
                ..AdamWOptions::default()
            },
        )
        .with_zero(Zero::new(cfg.zero, DP_AXIS)?)?;
        Ok(GptRun {
            model,
            optimizer,
            corpus,
            train_windows,
            heldout_windows,
            placement,
            rows,
            step: 0,
            cfg: cfg.clone(),
            step_peak: (None, 0),
            step_footprint: Footprint::default(),
        })
    }

    /// Global `[batch, T]` ids and targets of `step` from the training or held-out tokens.
    fn batch(&self, heldout: bool, step: u64) -> Result<(Tensor, Tensor)> {
        let (sampler, tokens) = if heldout {
            (&self.heldout_windows, self.corpus.heldout())
        } else {
            (&self.train_windows, self.corpus.train())
        };
        let b = sampler
            .rows(tokens, step, self.rows.clone())
            .map_err(|e| program_err("GptRun::batch", e.to_string()))?;
        let sbp = NdSbp::new([Sbp::S(0), Sbp::B]);
        let global = |v: Vec<i64>| {
            Tensor::from_vec(v, [b.rows, b.seq_len])?.to_global(&self.placement, sbp.clone())
        };
        Ok((global(b.inputs)?, global(b.targets)?))
    }

    /// Bytes of this rank's parameters, gradients and optimizer state now.
    pub fn footprint(&self) -> Footprint {
        Footprint::measure(&self.model.parameters(), &self.optimizer)
    }

    /// One step: forward, backward, update. Returns the loss (every rank gets it).
    pub fn train_step(&mut self) -> Result<f64> {
        let (ids, targets) = self.batch(false, self.step)?;
        self.optimizer.zero_grad();
        oxiflow::memory::reset_peaks();
        let loss = self
            .model
            .loss(&ids, &targets, Pass::Train { step: self.step })?;
        loss.backward()?;
        self.step_peak = (
            oxiflow::memory::host().map(|m| m.peak),
            oxiflow::memory::device().peak,
        );
        self.step_footprint = self.footprint();
        self.optimizer.step()?;
        self.step += 1;
        let _ng = no_grad();
        first("train_step", &loss)
    }

    /// Mean loss over `EVAL_BATCHES` fixed batches of held-out windows.
    pub fn heldout_loss(&self) -> Result<f64> {
        let _ng = no_grad();
        let mut sum = 0.0;
        for i in 0..EVAL_BATCHES {
            let (ids, targets) = self.batch(true, i)?;
            sum += first(
                "heldout_loss",
                &self.model.loss(&ids, &targets, Pass::Eval)?,
            )?;
        }
        Ok(sum / EVAL_BATCHES as f64)
    }

    /// Tokens per step (the global batch times the sequence length).
    pub fn tokens_per_step(&self) -> usize {
        self.cfg.batch_size * self.model.cfg.seq_len
    }

    /// `prompt` continued by `n` tokens: greedy at temperature 0, else sampled from the
    /// softmax at that temperature with draws from `seed` (every rank draws the same).
    pub fn generate(&self, prompt: &str, n: usize, temperature: f64, seed: u64) -> Result<String> {
        let _ng = no_grad();
        let t = self.model.cfg.seq_len;
        let vocab = self.model.cfg.vocab;
        let (dp, _) = self.cfg.mesh;
        let mut ids = ByteTokenizer.encode(prompt);
        if ids.is_empty() {
            ids.push(u16::from(b'\n'));
        }
        let start = ids.len();
        let sbp = NdSbp::new([Sbp::S(0), Sbp::B]);
        for i in 0..n {
            // The last t tokens, padded at the end: the causal mask hides the padding.
            let ctx = &ids[ids.len().saturating_sub(t)..];
            let mut row = vec![0i64; t];
            for (r, &c) in row.iter_mut().zip(ctx) {
                *r = i64::from(c);
            }
            let x = Tensor::from_vec(row, [1, t])?.to_global(&self.placement, sbp.clone())?;
            let logits = self
                .model
                .forward(&x, Pass::Eval)?
                .narrow(0, 0, 1)?
                .narrow(1, ctx.len() - 1, 1)?
                .cast(DType::F64)?
                .to_global(&self.placement, NdSbp::broadcast(2))?
                .to_vec::<f64>()?;
            if logits.len() != vocab {
                return Err(program_err(
                    "generate",
                    format!(
                        "{} logits for a vocabulary of {vocab} (dp {dp})",
                        logits.len()
                    ),
                ));
            }
            let next = pick(&logits, temperature, seed, i as u64);
            ids.push(u16::try_from(next).unwrap_or(0));
        }
        Ok(ByteTokenizer.decode(&ids[start..]))
    }

    /// Saves the model, optimizer state and `meta` plus the step (every rank calls).
    pub fn save(&self, path: &Path, meta: &Metadata, opts: &SaveOptions) -> Result<()> {
        let mut meta = meta.clone();
        meta.insert("step".into(), self.step.to_string());
        meta.insert("data.step".into(), self.step.to_string());
        meta.insert(
            "data.windows_drawn".into(),
            (self.step * self.cfg.batch_size as u64).to_string(),
        );
        meta.insert("data.source".into(), self.corpus.source.to_string());
        checkpoint::save(
            path,
            &self.model.parameters(),
            Some(&self.optimizer as &dyn Optimizer),
            &meta,
            opts,
        )
    }

    /// Loads a checkpoint saved under any layout and continues at its data position.
    pub fn resume(&mut self, path: &Path, step: u64) -> Result<()> {
        checkpoint::load(
            path,
            &self.model.parameters(),
            Some(&mut self.optimizer as &mut dyn Optimizer),
        )?;
        self.step = step;
        Ok(())
    }
}

/// The index of the next token: the arg-max at temperature 0, else a draw from
/// softmax(logits / temperature).
fn pick(logits: &[f64], temperature: f64, seed: u64, draw: u64) -> usize {
    let best =
        logits.iter().enumerate().fold(
            (0, f64::NEG_INFINITY),
            |a, (i, &v)| if v > a.1 { (i, v) } else { a },
        );
    if temperature <= 0.0 {
        return best.0;
    }
    let w: Vec<f64> = logits
        .iter()
        .map(|&v| ((v - best.1) / temperature).exp())
        .collect();
    let mut u = oxiflow::tensor::rng::uniform(seed, draw) * w.iter().sum::<f64>();
    for (i, x) in w.iter().enumerate() {
        if u < *x {
            return i;
        }
        u -= x;
    }
    best.0
}
