//! `Trainer`: one loop for any `TrainModel` under any layout. A step sets the scheduled
//! learning rate, runs its batch as `grad_accum` parts (each through the pipeline runner's
//! micro-batches when pipelined, `pipelined.rs`; losses scaled so the gradients are the whole batch's; the
//! data-parallel gradients reduced in buckets during the last part's backward pass, or after
//! the last pipelined part, when `bucket_bytes` is set), measures
//! the gradients' global norm while the optimizer boxes them (`Optimizer::prepare`), lets the
//! hooks see the step before its update, and applies the update clipped to `clip_grad`.

use std::path::Path;
use std::time::Instant;

use oxiflow_collectives::DType;
use oxiflow_dtype::MixedPrecision;
use oxiflow_models::checkpoint::{self, LoadOptions, Metadata, SaveOptions};
use oxiflow_models::footprint::Footprint;
use oxiflow_models::nn::Pass;
use oxiflow_models::optim::{
    clip_factor, first_non_finite, guard_ratio, norm_of, BucketLaunch, GradBuckets, Optimizer,
    QueuedSum, SyncMode,
};
use oxiflow_models::pipeline::PipelineSpec;
use oxiflow_placement::Placement;
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::{install_grad_hook, no_grad, Tensor, TensorError};

use oxiflow_compile::CompiledStep;

use crate::error::TrainError;
use crate::model::{Batch, BatchSource, TrainModel};
use crate::schedule::LrSchedule;

/// A pipelined job's layout as this rank sees it.
#[derive(Clone, Debug)]
pub struct PipelineRun {
    pub spec: PipelineSpec,
    /// This rank's stage.
    pub stage: usize,
    /// Every rank of the job as a 1-d placement (where the step's loss and times meet).
    pub world: Placement,
    /// The last stage's placement.
    pub last: Placement,
}

/// How steps are made.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub schedule: LrSchedule,
    /// Clip the gradients' global norm to this.
    pub clip_grad: Option<f64>,
    /// Parts each step's batch runs in (gradient accumulation).
    pub grad_accum: usize,
    /// Bytes per bucket of data-parallel gradients reduced during the backward pass (see
    /// `GradBuckets`); 0: no buckets, each gradient is reduced by the optimizer's `prepare`
    /// (or, under ZeRO-2, boxed to its shard at the end of each backward pass).
    pub bucket_bytes: usize,
    /// The precision policy the model's parameters were given: the buckets move as its
    /// `reduce` dtype (None: as the gradients' own).
    pub precision: Option<MixedPrecision>,
    pub pipeline: Option<PipelineRun>,
    /// Run each step's forward and backward passes (the whole pipeline schedule when
    /// pipelined) as a compiled program (the methods in `compiled_step.rs`).
    pub compile: bool,
}

/// What one step did.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    /// When the step compiled (`TrainOptions::compile`): why it compiled again, if it did,
    /// and the compile line (`compiled: N ops -> M kernels, ...`).
    pub compiled: Option<String>,
    /// The step count after this step.
    pub step: u64,
    /// The mean loss of the step's batch.
    pub loss: f64,
    /// The global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// Wall time of the step.
    pub seconds: f64,
    /// Host (when counted) and device peak bytes during the forward and backward passes.
    pub peak: (Option<usize>, usize),
    /// Parameters, gradients and optimizer state after the backward pass.
    pub footprint: Footprint,
    /// Pipelined steps: the mean over ranks of the fraction of the schedule's time a rank did
    /// not compute.
    pub bubble: Option<f64>,
    /// The gradient buckets reduced, with the accumulation part whose backward pass (or, when
    /// pipelined, the end of whose schedule) reduced them.
    pub buckets: Vec<(usize, BucketLaunch)>,
    /// The update was skipped (a hook said so, or the device skipped a step whose loss or
    /// norm is not finite).
    pub skipped: bool,
    /// When the loss or the gradient norm is not finite: the first non-finite tensor ("the
    /// loss", or the gradient of a parameter, found the same on every rank).
    pub non_finite: Option<String>,
}

/// What a hook decides about a step's update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Update,
    Skip,
}

/// Code the loop runs on every step (e.g. health guards): `before_update` sees the step's
/// loss and gradient norm (every rank the same values) before the optimizer changes anything,
/// unless every hook skips only steps whose loss or norm is not finite
/// (`skips_only_non_finite`): the update then runs before they decide, skipped on the device
/// exactly on those steps, and a skip finds nothing changed.
pub trait StepHook {
    fn before_update(&mut self, _step: &StepStats) -> Result<Verdict, TrainError> {
        Ok(Verdict::Update)
    }
    /// Whether `before_update` gives `Skip` only for a step whose loss or gradient norm is not
    /// finite (an error is fine). The default, false, makes the loop wait for every hook's
    /// verdict before the update.
    fn skips_only_non_finite(&self) -> bool {
        false
    }
    fn after_step(&mut self, _step: &StepStats) -> Result<(), TrainError> {
        Ok(())
    }
}

/// A model, its optimizer and data, and the step count.
pub struct Trainer<M: TrainModel> {
    pub model: M,
    pub optimizer: Box<dyn Optimizer>,
    pub data: Box<dyn BatchSource>,
    pub opts: TrainOptions,
    pub step: u64,
    hooks: Vec<Box<dyn StepHook>>,
    /// The compiled forward and backward passes (`opts.compile`).
    pub(crate) compiled: CompiledStep,
}

pub(crate) fn loop_err(op: &'static str, detail: String) -> TrainError {
    TrainError::Tensor(TensorError::Kernel { op, detail })
}

/// The value of a one-element tensor, as f64, on every rank of its placement.
pub(crate) fn first(op: &'static str, t: &Tensor) -> Result<f64, TrainError> {
    let v = t.cast(DType::F64)?.to_vec::<f64>()?;
    v.first()
        .copied()
        .ok_or_else(|| loop_err(op, "empty result".into()))
}

/// The value of the 0-d `loss` and of the queued sum `sum`, read in one transfer when the sum
/// is one part on the loss's placement (or local on its device), else one after the other
/// (everything is queued already, so the host waits for the device once either way).
fn read_with_sum(loss: &Tensor, sum: &QueuedSum) -> Result<(f64, f64), TrainError> {
    let loss = loss.cast(DType::F64)?;
    if let [part] = sum.parts() {
        let pair = match (loss.placement(), part.placement()) {
            (Some(p), Some(q)) if p == q => {
                let all = NdSbp::broadcast(p.ndim());
                Some([loss.to_global(p, all.clone())?, part.to_global(p, all)?])
            }
            (None, None) if loss.device() == part.device() => Some([loss.clone(), part.clone()]),
            _ => None,
        };
        if let Some([a, b]) = pair {
            let both = Tensor::concat(&[&a.reshape([1])?, &b.reshape([1])?], 0)?;
            if let [l, s] = both.to_vec::<f64>()?.as_slice() {
                return Ok((*l, *s));
            }
        }
    }
    Ok((first("train_step", &loss)?, sum.read()?))
}

impl<M: TrainModel> Trainer<M> {
    pub fn new(
        model: M,
        optimizer: Box<dyn Optimizer>,
        data: Box<dyn BatchSource>,
        opts: TrainOptions,
    ) -> Result<Trainer<M>, TrainError> {
        if opts.grad_accum == 0 {
            return Err(loop_err(
                "Trainer::new",
                "grad_accum must be at least 1".into(),
            ));
        }
        if opts.pipeline.is_some() && model.pipeline().is_none() {
            return Err(loop_err(
                "Trainer::new",
                "a pipelined run needs a model with stages".into(),
            ));
        }
        Ok(Trainer {
            model,
            optimizer,
            data,
            opts,
            step: 0,
            hooks: Vec::new(),
            compiled: CompiledStep::new(),
        })
    }

    /// Runs `hook` on every later step.
    pub fn add_hook(&mut self, hook: Box<dyn StepHook>) {
        self.hooks.push(hook);
    }

    /// One step: forward and backward over the step's batch, the gradients' norm, the update.
    /// Without a pipeline the host waits for the device once: the norm's kernels, and the
    /// update clipped by a device clip ratio where the optimizer can run one, are queued
    /// behind the backward pass, then the loss and the norm are read together, and the hooks'
    /// verdict commits or drops the queued update (or, guarded on the device, finds it
    /// applied or skipped already: see [`StepHook`]).
    pub fn train_step(&mut self) -> Result<StepStats, TrainError> {
        let start = Instant::now();
        let step = self.step;
        let lr = self.opts.schedule.at(step);
        self.optimizer.set_lr(lr);
        self.optimizer.zero_grad();
        oxiflow_tensor::memory::reset_peaks();
        let mut buckets = Vec::new();
        let mut compiled = None;
        let (read_loss, queued_loss, bubble) = if self.opts.pipeline.is_some() && self.opts.compile
        {
            let (loss, line) = self.compiled_pipelined_batch(step)?;
            compiled = line;
            (Some(loss), None, None)
        } else if self.opts.pipeline.is_some() {
            let parts = self.pipelined_batches(step)?;
            let done = self.pipelined_parts(step, &parts)?;
            buckets = done.launched;
            let (l, b) = self.pipelined_loss(&done.losses, Some((done.busy, done.span)))?;
            (Some(l), None, b)
        } else if self.opts.compile {
            let (loss, line) = self.compiled_batch(step)?;
            compiled = line;
            (Some(loss), None, None)
        } else {
            (None, Some(self.plain_batch(step, &mut buckets)?), None)
        };
        let mut stats = StepStats {
            step: step + 1,
            lr,
            peak: (
                oxiflow_tensor::memory::host().map(|m| m.peak),
                oxiflow_tensor::memory::device().peak,
            ),
            footprint: Footprint::measure(&self.model.parameters(), self.optimizer.as_ref()),
            bubble,
            buckets,
            compiled,
            ..StepStats::default()
        };
        let sum = self.optimizer.prepare_queued()?;
        // Where every hook skips only the steps whose loss or norm is not finite, the update
        // runs at once (in place where the optimizer can), guarded on the device: a non-finite
        // loss or norm makes its ratio NaN, which leaves everything as it was, so the hooks'
        // skip has nothing to drop. Else it is queued, then committed or dropped by the verdict.
        // Either way the device runs it while the host reads the loss and norm.
        let guarded = match &read_loss {
            _ if !self.hooks.iter().all(|h| h.skips_only_non_finite()) => None,
            Some(l) if !l.is_finite() => None,
            Some(_) => guard_ratio(&sum, self.opts.clip_grad, None)?,
            None => guard_ratio(&sum, self.opts.clip_grad, queued_loss.as_ref())?,
        };
        let applied = match &guarded {
            Some(r) => self.optimizer.apply_guarded_now(r)?,
            None => false,
        };
        let queued = !applied && self.optimizer.queue_clipped(&sum, self.opts.clip_grad)?;
        let (loss, sum) = match (read_loss, queued_loss) {
            (Some(l), _) => (l, sum.read()?),
            (None, Some(t)) => {
                let (total, sum) = read_with_sum(&t, &sum)?;
                (total / self.opts.grad_accum as f64, sum)
            }
            (None, None) => return Err(loop_err("train_step", "no loss".into())),
        };
        stats.loss = loss;
        stats.grad_norm = norm_of(sum);
        stats.non_finite = self.first_non_finite(stats.loss, stats.grad_norm)?;
        if applied && !(stats.loss.is_finite() && stats.grad_norm.is_finite()) {
            // The device left everything as it was: the step does not count.
            let n = self.optimizer.step_count();
            self.optimizer.set_step_count(n.saturating_sub(1));
            stats.skipped = true;
        }
        let mut verdict = Verdict::Update;
        for h in &mut self.hooks {
            if h.before_update(&stats)? == Verdict::Skip {
                verdict = Verdict::Skip;
            }
        }
        match verdict {
            // The prepared gradients were kept for the checks above.
            Verdict::Update if applied => self.optimizer.discard(),
            // A queued update equals `apply`'s with the norm's clip factor.
            Verdict::Update if queued => self.optimizer.commit()?,
            Verdict::Update => self
                .optimizer
                .apply(clip_factor(stats.grad_norm, self.opts.clip_grad))?,
            // Only a step the device skipped (above) is skipped by such hooks.
            Verdict::Skip if applied => {
                self.optimizer.discard();
                stats.skipped = true;
            }
            Verdict::Skip => {
                self.optimizer.discard();
                stats.skipped = true;
            }
        }
        self.step += 1;
        stats.seconds = start.elapsed().as_secs_f64();
        for h in &mut self.hooks {
            h.after_step(&stats)?;
        }
        Ok(stats)
    }

    /// The first non-finite tensor of a step with loss `loss` and gradient norm `norm`: None
    /// when both are finite, else the loss, or the first parameter whose prepared gradient
    /// holds a NaN or infinity (a global search, only on such a step).
    fn first_non_finite(&self, loss: f64, norm: f64) -> Result<Option<String>, TrainError> {
        if loss.is_finite() && norm.is_finite() {
            return Ok(None);
        }
        if !loss.is_finite() {
            return Ok(Some("the loss".into()));
        }
        let (index, grads): (Vec<usize>, Vec<Tensor>) =
            self.optimizer.prepared_gradients().into_iter().unzip();
        Ok(Some(match first_non_finite(&grads)? {
            Some(i) => {
                let name = index
                    .get(i)
                    .and_then(|&p| self.optimizer.params().get(p))
                    .map_or("?", |p| p.name());
                format!("the gradient of {name}")
            }
            None => "no single gradient (every value is finite; their squares overflow)".into(),
        }))
    }

    /// The bucketed gradient reduction of one backward pass in `mode` (None without buckets).
    pub(crate) fn grad_buckets(&self, mode: SyncMode) -> Option<std::sync::Arc<GradBuckets>> {
        (self.opts.bucket_bytes > 0).then(|| {
            GradBuckets::new(
                self.optimizer.params(),
                self.optimizer.zero(),
                self.opts.bucket_bytes,
                mode,
                self.opts.precision.map(|p| p.reduce()),
            )
        })
    }

    /// The step's batch in `grad_accum` parts without the pipeline runner; the sum of the
    /// parts' losses, a 0-d f64 tensor not read yet. Only the last part's backward pass
    /// reduces the gradients (with buckets).
    fn plain_batch(
        &mut self,
        step: u64,
        launched: &mut Vec<(usize, BucketLaunch)>,
    ) -> Result<Tensor, TrainError> {
        let k = self.opts.grad_accum;
        let mut total: Option<Tensor> = None;
        for a in 0..k {
            let batch = self.data.train_batch(step, a, k)?;
            let (l, buckets) = self.part(&batch, step, a)?;
            if let Some(b) = buckets {
                launched.extend(b.launched().into_iter().map(|l| (a, l)));
            }
            let _ng = no_grad();
            total = Some(match total {
                Some(t) => t.add(&l)?,
                None => l,
            });
        }
        let _ng = no_grad();
        total.ok_or_else(|| loop_err("train_step", "no part ran".into()))
    }

    /// Part `a` of step `step`'s `grad_accum` parts: the forward and backward passes of
    /// `batch` (the loss scaled by 1/parts; only the last part's backward pass reduces the
    /// gradients, in buckets when set); the part's loss (detached, f64) and its buckets.
    pub(crate) fn part(
        &self,
        batch: &Batch,
        step: u64,
        a: usize,
    ) -> Result<(Tensor, Option<std::sync::Arc<GradBuckets>>), TrainError> {
        let k = self.opts.grad_accum;
        let loss = self.model.loss(batch, Pass::Train { step }.micro(a, k))?;
        let mode = if a + 1 == k {
            SyncMode::Reduce
        } else {
            SyncMode::Defer
        };
        let buckets = self.grad_buckets(mode);
        {
            let _hook = buckets.clone().map(|b| install_grad_hook(b));
            if k == 1 {
                loss.backward()?;
            } else {
                loss.mul_scalar(1.0 / k as f64)?.backward()?;
            }
        }
        let _ng = no_grad();
        Ok((loss.detach().cast(DType::F64)?, buckets))
    }

    /// The value of a 0-d result on every rank (through the world when pipelined).
    fn read_scalar(&self, op: &'static str, t: &Tensor) -> Result<f64, TrainError> {
        match &self.opts.pipeline {
            None => first(op, t),
            Some(run) => first(
                op,
                &t.cast(DType::F64)?
                    .to_global(&run.world, NdSbp::broadcast(1))?,
            ),
        }
    }

    /// The mean loss over the data's held-out batches.
    pub fn heldout_loss(&mut self) -> Result<f64, TrainError> {
        let _ng = no_grad();
        let n = self.data.heldout_batches().max(1);
        let mut sum = 0.0;
        for i in 0..n {
            let batch = self.data.heldout_batch(i)?;
            let loss = self.model.loss(&batch, Pass::Eval)?;
            sum += self.read_scalar("heldout_loss", &loss)?;
        }
        Ok(sum / n as f64)
    }

    /// Saves the trainable parameters (a frozen base is not saved: it is rebuilt as it was
    /// made), optimizer state, `meta`, the step and the data position (every rank calls). Training state holding a NaN or infinity is refused before anything is
    /// written, so a checkpoint already at `path` is kept.
    pub fn save(&self, path: &Path, meta: &Metadata, opts: &SaveOptions) -> Result<(), TrainError> {
        let params = self.model.trainable_parameters();
        let o = self.optimizer.as_ref();
        let mut names: Vec<String> = params.iter().map(|p| p.name().to_string()).collect();
        let mut state: Vec<Tensor> = params.iter().map(|p| p.value()).collect();
        for (i, p) in o.params().iter().enumerate() {
            for slot in o.slot_names() {
                if let Some(t) = o.state(i, slot) {
                    names.push(format!("{slot} of {}", p.name()));
                    state.push(t);
                }
            }
        }
        if let Some(i) = first_non_finite(&state)? {
            return Err(TrainError::NonFinite {
                step: self.step,
                detail: format!(
                    "{} holds a NaN or infinity: refusing to save it to {} (what is there is kept)",
                    names.get(i).map_or("?", String::as_str),
                    path.display()
                ),
            });
        }
        let mut meta = meta.clone();
        meta.insert("step".into(), self.step.to_string());
        meta.extend(self.data.position(self.step));
        Ok(checkpoint::save(
            path,
            &params,
            Some(self.optimizer.as_ref()),
            &meta,
            opts,
        )?)
    }

    /// Loads a checkpoint saved under any layout and continues at its step and the data
    /// position it records; returns the step.
    pub fn resume(&mut self, path: &Path) -> Result<u64, TrainError> {
        self.resume_with(path, &LoadOptions::default())
    }

    /// `resume` with load options (e.g. starting the optimizer fresh when the checkpoint holds
    /// no state of this optimizer).
    pub fn resume_with(&mut self, path: &Path, opts: &LoadOptions) -> Result<u64, TrainError> {
        let meta = checkpoint::load_with(
            path,
            &self.model.trainable_parameters(),
            Some(self.optimizer.as_mut()),
            opts,
        )?
        .metadata;
        let step = meta
            .get("step")
            .ok_or_else(|| TrainError::Resume {
                path: path.to_path_buf(),
                detail: "the checkpoint records no step".into(),
            })?
            .parse::<u64>()
            .map_err(|e| TrainError::Resume {
                path: path.to_path_buf(),
                detail: format!("bad step: {e}"),
            })?;
        self.data.resume(step, &meta)?;
        self.step = step;
        Ok(step)
    }
}
