//! GPT training for `train --model gpt`: a byte-level GPT on a text corpus, on a mesh
//! `[dp, tp]` (batch over dp, Megatron tensor parallelism and optionally sequence parallelism
//! over tp), or `[pp, dp, tp]` with pipeline stages (micro-batches through a schedule). The
//! model's initial values and every batch depend only on the seed and the step, so every
//! layout trains the same function; checkpoints carry the step, which is the data loader's
//! position, and resume under any layout.

use std::path::{Path, PathBuf};

use oxiflow::checkpoint::{self, Metadata, SaveOptions};
use oxiflow::data::{ByteTokenizer, Corpus, WindowSampler};
use oxiflow::footprint::Footprint;
use oxiflow::nn::gpt::{Gpt, GptConfig, GptLayout, Pass, Recompute, StageSplit, DP_AXIS};
use oxiflow::nn::Module;
use oxiflow::optim::{AdamW, AdamWOptions, Optimizer, Zero};
use oxiflow::pipeline::{self, MicroBatches, PipelineSpec};
use oxiflow::prelude::*;
use oxiflow::{no_grad, Context, Result};

use crate::classifier::mesh_placement;

/// Held-out windows scored by `heldout_loss` (batches of the training batch size).
pub const EVAL_BATCHES: u64 = 4;

/// Everything that defines a GPT training run.
#[derive(Clone, Debug)]
pub struct GptTrainConfig {
    /// Mesh `[dp, tp]` of each pipeline stage (stage s on ranks `s*dp*tp..(s+1)*dp*tp`).
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
    /// Pipeline stages (mesh axis 0 when above 1), micro-batches and schedule.
    pub pipeline: PipelineSpec,
}

impl GptTrainConfig {
    /// Whether steps run through the pipeline runner (stages, micro-batches or chunks).
    pub fn pipelined(&self) -> bool {
        let p = &self.pipeline;
        p.stages > 1 || p.micro_batches > 1 || p.virtual_stages > 1
    }
}

/// A training run: model, optimizer, corpus, samplers and step counter.
pub struct GptRun {
    pub model: Gpt,
    pub optimizer: AdamW,
    pub corpus: Corpus,
    train_windows: WindowSampler,
    heldout_windows: WindowSampler,
    /// The first stage's placement (the whole mesh without pipeline stages).
    placement: Placement,
    /// The last stage's placement, and every rank of the world as a 1-d placement.
    last: Placement,
    world: Placement,
    /// This rank's pipeline stage.
    stage: usize,
    /// This rank's rows of every batch.
    rows: std::ops::Range<usize>,
    /// This rank's data-parallel coordinate.
    dp_coord: usize,
    pub step: u64,
    pub cfg: GptTrainConfig,
    /// Host and device peak bytes during the last step's forward and backward (host: when the
    /// counting allocator is installed).
    pub step_peak: (Option<usize>, usize),
    /// Parameters, gradients and optimizer state after the last step's backward pass.
    pub step_footprint: Footprint,
    /// Per step (pipelined runs): the mean over ranks of the fraction of the step's schedule
    /// time (its slowest rank's) a rank did not compute.
    pub bubbles: Vec<f64>,
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
        let spec = cfg.pipeline;
        let (pp, m) = (spec.stages, spec.micro_batches);
        spec.validate(cfg.model.layers)?;
        if !cfg.batch_size.is_multiple_of(dp * m) {
            return Err(program_err(
                "GptRun::new",
                format!(
                    "--batch-size {} must be a multiple of --dp {dp} x --micro-batches {m}",
                    cfg.batch_size
                ),
            ));
        }
        if pp > 1 && cfg.device != DeviceType::Cpu {
            // Between device pieces boxing is an NCCL all-to-all, which waits for the receiver:
            // two stages sending to each other (1F1B) would wait for each other.
            return Err(program_err(
                "GptRun::new",
                format!(
                    "--pp {pp} needs --device cpu: pipeline sends must not wait for the receiver, and device boxing does"
                ),
            ));
        }
        let rank = Context::current()
            .ok_or_else(|| program_err("GptRun::new", "no runtime context".into()))?
            .rank();
        let stages: Vec<Placement> = if pp == 1 {
            vec![mesh_placement(dp, tp)?.with_device(cfg.device)]
        } else {
            let full = mesh_placement(pp * dp, tp)?
                .reshaped([pp, dp, tp])
                .map_err(|e| program_err("GptRun::new", e.to_string()))?
                .with_device(cfg.device);
            (0..pp)
                .map(|s| full.sub_mesh(0, s))
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| program_err("GptRun::new", e.to_string()))?
        };
        let stage = stages
            .iter()
            .position(|p| p.contains(rank))
            .ok_or_else(|| {
                program_err(
                    "GptRun::new",
                    format!("rank {rank} is in no stage of the mesh [pp {pp}, dp {dp}, tp {tp}]"),
                )
            })?;
        let placement = stages[0].clone();
        let last = stages[pp - 1].clone();
        let world = Placement::new_1d(cfg.device, (0..pp * dp * tp).collect::<Vec<usize>>())
            .map_err(|e| program_err("GptRun::new", e.to_string()))?;
        let coord = stages[stage].coord_of(rank).unwrap_or_default();
        let dp_coord = coord.get(DP_AXIS).copied().unwrap_or(0);
        let per = cfg.batch_size / dp;
        let rows = dp_coord * per..(dp_coord + 1) * per;
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
        let mut model = if pp == 1 && spec.virtual_stages == 1 {
            Gpt::new(&model_cfg, &GptLayout::Mesh(placement.clone()))?
        } else {
            let layouts = stages.iter().cloned().map(GptLayout::Mesh).collect();
            let split = StageSplit::new(model_cfg.layers, layouts, spec.virtual_stages)?;
            Gpt::new_split(&model_cfg, split)?
        };
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
            last,
            world,
            stage,
            rows,
            dp_coord,
            step: 0,
            cfg: cfg.clone(),
            step_peak: (None, 0),
            step_footprint: Footprint::default(),
            bubbles: Vec::new(),
        })
    }

    /// This rank's part of rows `rows` of step `step`'s batch, as global `[rows, T]` ids on
    /// the first stage and targets on the last (split over the data-parallel axis).
    fn window_rows(
        &self,
        heldout: bool,
        step: u64,
        rows: std::ops::Range<usize>,
    ) -> Result<(Tensor, Tensor)> {
        let (sampler, tokens) = if heldout {
            (&self.heldout_windows, self.corpus.heldout())
        } else {
            (&self.train_windows, self.corpus.train())
        };
        let b = sampler
            .rows(tokens, step, rows)
            .map_err(|e| program_err("GptRun::batch", e.to_string()))?;
        let sbp = NdSbp::new([Sbp::S(0), Sbp::B]);
        let global = |v: Vec<i64>, p: &Placement| {
            Tensor::from_vec(v, [b.rows, b.seq_len])?.to_global(p, sbp.clone())
        };
        Ok((
            global(b.inputs, &self.placement)?,
            global(b.targets, &self.last)?,
        ))
    }

    /// The micro-batches of training step `step`: micro-batch `j` is rows
    /// `[j B/m, (j+1) B/m)` of the batch, split over the data-parallel axis.
    fn micro_batches(&self, step: u64) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let m = self.cfg.pipeline.micro_batches;
        let per_mb = self.cfg.batch_size / m;
        let per = per_mb / self.cfg.mesh.0;
        let (mut ids, mut targets) = (Vec::with_capacity(m), Vec::with_capacity(m));
        for j in 0..m {
            let at = j * per_mb + self.dp_coord * per;
            let (i, t) = self.window_rows(false, step, at..at + per)?;
            ids.push(i);
            targets.push(t);
        }
        Ok((ids, targets))
    }

    /// A 0-d (or one-element) tensor's value on every rank of the world.
    fn read_scalar(&self, op: &'static str, t: &Tensor) -> Result<f64> {
        if self.cfg.pipeline.stages == 1 {
            return first(op, t);
        }
        let t = t
            .cast(DType::F64)?
            .to_global(&self.world, NdSbp::broadcast(1))?;
        first(op, &t)
    }

    /// Global `[batch, T]` ids (first stage) and targets (last stage) of `step` from the
    /// training or held-out tokens.
    fn batch(&self, heldout: bool, step: u64) -> Result<(Tensor, Tensor)> {
        self.window_rows(heldout, step, self.rows.clone())
    }

    /// Bytes of this rank's parameters, gradients and optimizer state now.
    pub fn footprint(&self) -> Footprint {
        Footprint::measure(&self.model.parameters(), &self.optimizer)
    }

    /// One step: forward, backward, update. Returns the loss (every rank gets it).
    pub fn train_step(&mut self) -> Result<f64> {
        if self.cfg.pipelined() {
            return self.pipeline_step();
        }
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

    /// One step through this rank's pipeline schedule, then the update. One world reduction
    /// brings the loss (from the last stage) and every rank's busy and wall times to all.
    fn pipeline_step(&mut self) -> Result<f64> {
        let (ids, targets) = self.micro_batches(self.step)?;
        self.optimizer.zero_grad();
        oxiflow::memory::reset_peaks();
        let report = pipeline::run_step(
            &self.model,
            &self.cfg.pipeline,
            self.stage,
            &MicroBatches {
                ids: &ids,
                targets: &targets,
            },
            Pass::Train { step: self.step },
        )?;
        self.step_peak = (
            oxiflow::memory::host().map(|m| m.peak),
            oxiflow::memory::device().peak,
        );
        self.step_footprint = self.footprint();
        self.optimizer.step()?;
        self.step += 1;
        let _ng = no_grad();
        let rank = Context::current()
            .ok_or_else(|| program_err("train_step", "no runtime context".into()))?
            .rank();
        let loss = match &report.loss {
            Some(l) => first("train_step", l)?,
            None => 0.0,
        };
        let lead_of_last = self.last.ranks().first() == Some(&rank);
        // [loss, busy of every rank, schedule wall time of every rank]: each rank fills its
        // own slots; one sum over the world gives everyone all of them.
        let n = self.world.num_ranks();
        let mut mine = vec![0.0; 1 + 2 * n];
        if lead_of_last {
            mine[0] = loss;
        }
        mine[1 + rank] = report.busy.as_secs_f64();
        mine[1 + n + rank] = report.span.as_secs_f64();
        let all = Tensor::from_vec(mine, [1 + 2 * n])?
            .to_global(&self.world, NdSbp::new([Sbp::Partial(ReduceOp::Sum)]))?
            .to_vec::<f64>()?;
        // The step's schedule took as long as its slowest rank; the bubble is the mean
        // fraction of that time a rank did not compute.
        let step = all[1 + n..].iter().copied().fold(0.0, f64::max).max(1e-12);
        let busy = all[1..1 + n].iter().sum::<f64>() / n as f64;
        self.bubbles.push(1.0 - busy / step);
        Ok(all[0])
    }

    /// Mean loss over `EVAL_BATCHES` fixed batches of held-out windows.
    pub fn heldout_loss(&self) -> Result<f64> {
        let _ng = no_grad();
        let mut sum = 0.0;
        for i in 0..EVAL_BATCHES {
            let (ids, targets) = self.batch(true, i)?;
            sum += self.read_scalar(
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
                .cast(DType::F64)?;
            let logits = if self.cfg.pipeline.stages == 1 {
                logits.to_global(&self.placement, NdSbp::broadcast(2))?
            } else {
                logits.to_global(&self.world, NdSbp::broadcast(1))?
            }
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
    let mut u = oxiflow::rng::uniform(seed, draw) * w.iter().sum::<f64>();
    for (i, x) in w.iter().enumerate() {
        if u < *x {
            return i;
        }
        u -= x;
    }
    best.0
}
