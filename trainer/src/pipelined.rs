//! A pipelined step's batch on this rank: its micro-batches per accumulation part, the runs of
//! the pipeline schedule over them (with the bucketed reduction after the last part), and the
//! step's mean loss and bubble met over the world. The eager loop and the compiled step
//! (`compiled_step.rs`) share these.

use std::time::Duration;

use oxiflow_models::nn::Pass;
use oxiflow_models::optim::{BucketLaunch, SyncMode};
use oxiflow_models::pipeline::{self, MicroBatches};
use oxiflow_sbp::{NdSbp, ReduceOp, Sbp};
use oxiflow_tensor::{install_grad_hook, no_grad, Context, Tensor};

use crate::error::TrainError;
use crate::model::TrainModel;
use crate::trainer::{first, loop_err, Trainer};

/// One accumulation part of a pipelined step: its micro-batches' inputs and targets.
pub(crate) struct PartBatches {
    pub inputs: Vec<Tensor>,
    pub targets: Vec<Tensor>,
}

/// What the pipeline schedule's runs of a step gave on this rank.
pub(crate) struct PipelinedParts {
    /// Each part's mean loss (0-d, on the last stage's placement; none on other stages).
    pub losses: Vec<Tensor>,
    /// Time computing and wall time of the schedule runs.
    pub busy: Duration,
    pub span: Duration,
    /// The gradient buckets reduced after the last part.
    pub launched: Vec<(usize, BucketLaunch)>,
}

impl<M: TrainModel> Trainer<M> {
    /// Step `step`'s batch for the pipeline: per accumulation part, its micro-batches'
    /// inputs and targets.
    pub(crate) fn pipelined_batches(&mut self, step: u64) -> Result<Vec<PartBatches>, TrainError> {
        let m = self
            .opts
            .pipeline
            .as_ref()
            .ok_or_else(|| loop_err("train_step", "not pipelined".into()))?
            .spec
            .micro_batches;
        let k = self.opts.grad_accum;
        (0..k)
            .map(|a| {
                let mut part = PartBatches {
                    inputs: Vec::with_capacity(m),
                    targets: Vec::with_capacity(m),
                };
                for j in 0..m {
                    let b = self.data.train_batch(step, a * m + j, k * m)?;
                    part.inputs.push(b.inputs);
                    part.targets.push(b.targets);
                }
                Ok(part)
            })
            .collect()
    }

    /// Runs the pipeline schedule once per accumulation part of `parts`. With buckets the
    /// gradients stay local partial sums through every part and are reduced in buckets after
    /// the last one.
    pub(crate) fn pipelined_parts(
        &self,
        step: u64,
        parts: &[PartBatches],
    ) -> Result<PipelinedParts, TrainError> {
        let Some(run) = &self.opts.pipeline else {
            return Err(loop_err("train_step", "not pipelined".into()));
        };
        let model = self
            .model
            .pipeline()
            .ok_or_else(|| loop_err("train_step", "the model has no stages".into()))?;
        let k = parts.len();
        let mut out = PipelinedParts {
            losses: Vec::with_capacity(k),
            busy: Duration::ZERO,
            span: Duration::ZERO,
            launched: Vec::new(),
        };
        let deferred = self.grad_buckets(SyncMode::Defer);
        let _hook = deferred.map(|b| install_grad_hook(b));
        for (a, part) in parts.iter().enumerate() {
            let report = pipeline::run_step(
                model,
                &run.spec,
                run.stage,
                &MicroBatches {
                    inputs: &part.inputs,
                    targets: &part.targets,
                    scale: 1.0 / k as f64,
                },
                Pass::Train { step }.micro(a, k),
            )?;
            out.losses.extend(report.loss);
            out.busy += report.busy;
            out.span += report.span;
        }
        drop(_hook);
        if let Some(b) = self.grad_buckets(SyncMode::Reduce) {
            b.reduce_now()?;
            out.launched
                .extend(b.launched().into_iter().map(|l| (k - 1, l)));
        }
        Ok(out)
    }

    /// The mean loss of a pipelined step (every rank gets it) from its parts' `losses` (on
    /// the last stage; none elsewhere), and, given every rank's (busy, schedule wall time),
    /// the step's bubble: one reduction over the world.
    pub(crate) fn pipelined_loss(
        &self,
        losses: &[Tensor],
        timing: Option<(Duration, Duration)>,
    ) -> Result<(f64, Option<f64>), TrainError> {
        let Some(run) = &self.opts.pipeline else {
            return Err(loop_err("train_step", "not pipelined".into()));
        };
        let k = self.opts.grad_accum;
        let rank = Context::current()
            .ok_or_else(|| loop_err("train_step", "no runtime context".into()))?
            .rank();
        let lead_of_last = run.last.ranks().first() == Some(&rank);
        let _ng = no_grad();
        let mut loss = 0.0;
        for l in losses {
            let v = first("train_step", l)?;
            if lead_of_last {
                loss += v;
            }
        }
        // [loss, busy of every rank, schedule wall time of every rank]: each rank fills its
        // own slots; one sum over the world gives everyone all of them.
        let n = run.world.num_ranks();
        let mut mine = vec![0.0; 1 + 2 * n];
        mine[0] = loss / k as f64;
        let at = run
            .world
            .ranks()
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| loop_err("train_step", format!("rank {rank} is not in the job")))?;
        let (busy, span) = timing.unwrap_or_default();
        mine[1 + at] = busy.as_secs_f64();
        mine[1 + n + at] = span.as_secs_f64();
        let all = Tensor::from_vec(mine, [1 + 2 * n])?
            .to_global(&run.world, NdSbp::new([Sbp::Partial(ReduceOp::Sum)]))?
            .to_vec::<f64>()?;
        if timing.is_none() {
            return Ok((all[0], None));
        }
        // The schedule took as long as its slowest rank; the bubble is the mean fraction of
        // that time a rank did not compute.
        let slowest = all[1 + n..].iter().copied().fold(0.0, f64::max).max(1e-12);
        let mean_busy = all[1..1 + n].iter().sum::<f64>() / n as f64;
        Ok((all[0], Some(1.0 - mean_busy / slowest)))
    }
}
