//! A step's forward and backward passes as a compiled program (`TrainOptions::compile`,
//! `train --compile`): the step's batch (all its `grad_accum` parts, each part's
//! micro-batches when pipelined) and the parameters' leaves are the program's inputs; the
//! parts' losses and every parameter's gradient its outputs, which go back on the leaves for
//! the optimizer. Captured on the first step (run eagerly), replayed while the inputs keep
//! their shapes, dtypes and layouts and the parameters their matmul precision, compiled again
//! when they change. Pipelined, each rank
//! captures its own stage's run of the schedule: its forward and backward actions, the
//! sends and receives between stages (one-way transfers, replayed in the order the schedule
//! made them), the tied table's trip and the bucketed reduction after the last part; the
//! losses are read and met over the world after the replay, and the bubble, which needs the
//! schedule's per-rank waits, is measured on eager steps only. The gradients' norm, the health
//! checks and the update stay eager: they read values on the host and take per-step
//! hyperparameters (learning rate, step count), which a program would hold as constants.

use oxiflow_compile::{CompileError, CompiledStep, StepRun};
use oxiflow_models::nn::Parameter;
use oxiflow_models::optim::Optimizer;
use oxiflow_tensor::{no_grad, MatmulPrecision, Tensor, TensorError};

use crate::error::TrainError;
use crate::model::TrainModel;
use crate::trainer::{first, Trainer};

impl<M: TrainModel> Trainer<M> {
    /// Runs step `step`'s batch through the compiled program; returns the mean loss and, when the
    /// step compiled, the compile line (with why it compiled again).
    pub(crate) fn compiled_batch(
        &mut self,
        step: u64,
    ) -> Result<(f64, Option<String>), TrainError> {
        let t = self;
        let k = t.opts.grad_accum;
        let batches = (0..k)
            .map(|a| t.data.train_batch(step, a, k))
            .collect::<Result<Vec<_>, _>>()?;
        let inputs = batches
            .iter()
            .flat_map(|b| [b.inputs.clone(), b.targets.clone()])
            .collect();
        let body = |trainer: &Trainer<M>| -> Result<Vec<Tensor>, TrainError> {
            let mut total: Option<Tensor> = None;
            for (a, batch) in batches.iter().enumerate() {
                let (l, _) = trainer.part(batch, step, a)?;
                let _ng = no_grad();
                total = Some(match total {
                    Some(s) => s.add(&l)?,
                    None => l,
                });
            }
            let _ng = no_grad();
            let total = total.ok_or_else(|| {
                TrainError::Tensor(TensorError::Kernel {
                    op: "train_step",
                    detail: "no part ran".into(),
                })
            })?;
            Ok(vec![total.mul_scalar(1.0 / k as f64)?])
        };
        let (losses, line) = run_compiled(t, inputs, body)?;
        let [loss] = losses.as_slice() else {
            return Err(TrainError::Tensor(TensorError::Kernel {
                op: "train --compile",
                detail: format!("the compiled step gave {} losses for 1", losses.len()),
            }));
        };
        let _ng = no_grad();
        Ok((first("train_step", loss)?, line))
    }

    /// Runs step `step`'s pipelined batch (every part's run of the schedule on this rank's stage)
    /// through the compiled program; returns the mean loss (every rank gets it) and, when the step
    /// compiled, the compile line.
    pub(crate) fn compiled_pipelined_batch(
        &mut self,
        step: u64,
    ) -> Result<(f64, Option<String>), TrainError> {
        let t = self;
        let parts = t.pipelined_batches(step)?;
        let inputs = parts
            .iter()
            .flat_map(|p| p.inputs.iter().chain(&p.targets).cloned())
            .collect();
        let body = |trainer: &Trainer<M>| -> Result<Vec<Tensor>, TrainError> {
            Ok(trainer.pipelined_parts(step, &parts)?.losses)
        };
        let (losses, line) = run_compiled(t, inputs, body)?;
        let (loss, _) = t.pipelined_loss(&losses, None)?;
        Ok((loss, line))
    }
}

/// Runs `body` (the step's passes, returning what it computed besides the gradients) as the
/// compiled program of `batch` and the parameters' leaves; puts the gradients it gives back on
/// the leaves and returns `body`'s own outputs and, when it compiled, the compile line (and,
/// when that changed, how replays run).
fn run_compiled<M: TrainModel>(
    t: &mut Trainer<M>,
    batch: Vec<Tensor>,
    body: impl FnOnce(&Trainer<M>) -> Result<Vec<Tensor>, TrainError>,
) -> Result<(Vec<Tensor>, Option<String>), TrainError> {
    let mut compiled = std::mem::take(&mut t.compiled);
    let trainer = &*t;
    let ran = compiled_passes(&mut compiled, &*trainer.optimizer, batch, || body(trainer));
    t.compiled = compiled;
    let passes = ran?;
    let mut line = match passes.run {
        StepRun::Compiled(c) => Some(match &c.report.recompiled_because {
            Some(why) => format!("compiling again: {why}\n{}", c.report),
            None => c.report.to_string(),
        }),
        StepRun::Replayed => None,
    };
    for n in passes.notes {
        line = Some(match line {
            Some(l) => format!("{l}\n{n}"),
            None => n,
        });
    }
    Ok((passes.outputs, line))
}

/// What one call of [`compiled_passes`] did.
pub struct CompiledPasses {
    /// The outputs of the passes' own (the loss, say); the gradients are on the leaves.
    pub outputs: Vec<Tensor>,
    /// Whether the call compiled or replayed.
    pub run: StepRun,
    /// What changed in how replays run (one device graph, or launch by launch and why).
    pub notes: Vec<String>,
}

/// The matmul precision every parameter computes with (the model's policy, one for the whole
/// step), or a typed error naming two that differ.
fn matmul_precision_of(params: &[Parameter]) -> Result<MatmulPrecision, TensorError> {
    let Some(first) = params.first() else {
        return Ok(MatmulPrecision::F32);
    };
    let p = first.matmul_precision();
    match params.iter().find(|q| q.matmul_precision() != p) {
        None => Ok(p),
        Some(q) => Err(TensorError::Autograd {
            op: "compiled step",
            detail: format!(
                "parameters {} ({p}) and {} ({}) compute at different matmul precisions; a \
                 compiled step runs at one",
                first.name(),
                q.name(),
                q.matmul_precision()
            ),
        }),
    }
}

/// A training step's forward and backward passes `body` through `compiled`: `batch`, the
/// leaves of `optimizer`'s parameters and their compute copies (written by the optimizer with
/// each leaf, or cast now; for a master shard its gathered copy) are the program's inputs, so
/// the program reads the copies where eager reads them and casts nothing; `body`'s outputs
/// and every parameter's gradient are its outputs, and the gradients go back on the leaves
/// for the optimizer. A parameter without a gradient is an error (a compiled step needs every
/// one).
///
/// A whole leaf that the optimizer's ZeRO stage all-gathers anew after every step (ZeRO-1/2)
/// is the exception: the program casts it where layers first read it, as eager does, so each
/// cast waits only for its own gather and the forward pass runs under the later ones (cast
/// before the step, the casts would queue behind every gather).
pub fn compiled_passes<E>(
    compiled: &mut CompiledStep,
    optimizer: &dyn Optimizer,
    batch: Vec<Tensor>,
    body: impl FnOnce() -> Result<Vec<Tensor>, E>,
) -> Result<CompiledPasses, E>
where
    E: From<CompileError> + From<TensorError>,
{
    let (params, zero) = (optimizer.params(), optimizer.zero());
    let matmul = matmul_precision_of(params)?;
    let mut inputs = batch;
    inputs.extend(params.iter().map(Parameter::value));
    for p in params {
        if zero.gathers_leaf(&p.value()) {
            // The program casts it: a copy kept from before would be read as a constant.
            p.drop_copy();
        } else if let Some(gathered) = p.ensure_gathered()? {
            // A master shard: layers read its gathered copy alone.
            inputs.push(gathered);
        } else {
            inputs.extend(p.ensure_compute_copy()?);
        }
    }
    let step = || -> Result<Vec<Tensor>, E> {
        let mut out = body()?;
        let _ng = no_grad();
        for p in params {
            out.push(p.grad().ok_or_else(|| TensorError::Autograd {
                op: "compiled step",
                detail: format!(
                    "parameter {} got no gradient; a compiled step needs every parameter's",
                    p.name()
                ),
            })?);
            // The outputs hold it now (and a compile on a device drops the capture's before
            // its replay, which then needs no room for them).
            p.zero_grad();
        }
        Ok(out)
    };
    let ran = compiled.run_at(&inputs, matmul, step);
    let notes = compiled.take_notes();
    let (mut outputs, run) = ran?;
    let Some(own) = outputs.len().checked_sub(params.len()) else {
        return Err(TensorError::Kernel {
            op: "compiled step",
            detail: format!(
                "the compiled step gave {} outputs for {} gradients",
                outputs.len(),
                params.len()
            ),
        }
        .into());
    };
    let grads = outputs.split_off(own);
    for (p, g) in params.iter().zip(grads) {
        p.value().autograd().set_grad(Some(g));
    }
    Ok(CompiledPasses {
        outputs,
        run,
        notes,
    })
}
