//! A step's forward and backward passes as a compiled program (`TrainOptions::compile`,
//! `train --compile`): the step's batch (all its `grad_accum` parts) and the parameters'
//! leaves are the program's inputs; the mean loss and every parameter's gradient its outputs,
//! which go back on the leaves for the optimizer. Captured on the first step (run eagerly),
//! replayed while the inputs keep their shapes, dtypes and layouts, compiled again when they
//! change. The gradients' norm, the health checks and the update stay eager: they read values
//! on the host and take per-step hyperparameters (learning rate, step count), which a program
//! would hold as constants.

use oxiflow_compile::StepRun;
use oxiflow_models::nn::Parameter;
use oxiflow_tensor::{no_grad, Tensor, TensorError};

use crate::error::TrainError;
use crate::model::TrainModel;
use crate::trainer::{first, Trainer};

/// Runs step `step`'s batch through the compiled program; returns the mean loss and, when the
/// step compiled, the compile line (with why it compiled again).
pub(crate) fn compiled_batch<M: TrainModel>(
    t: &mut Trainer<M>,
    step: u64,
) -> Result<(f64, Option<String>), TrainError> {
    let k = t.opts.grad_accum;
    let batches = (0..k)
        .map(|a| t.data.train_batch(step, a, k))
        .collect::<Result<Vec<_>, _>>()?;
    let params: Vec<Parameter> = t.optimizer.params().to_vec();
    let mut inputs: Vec<Tensor> = Vec::with_capacity(2 * k + params.len());
    for b in &batches {
        inputs.push(b.inputs.clone());
        inputs.push(b.targets.clone());
    }
    inputs.extend(params.iter().map(Parameter::value));
    let mut compiled = std::mem::take(&mut t.compiled);
    let trainer = &*t;
    let body = || -> Result<Vec<Tensor>, TrainError> {
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
        let Some(total) = total else {
            return Err(TensorError::Kernel {
                op: "train_step",
                detail: "no part ran".into(),
            }
            .into());
        };
        let mut out = vec![total.mul_scalar(1.0 / k as f64)?];
        for p in &params {
            out.push(p.grad().ok_or_else(|| TensorError::Autograd {
                op: "train --compile",
                detail: format!(
                    "parameter {} got no gradient; a compiled step needs every parameter's",
                    p.name()
                ),
            })?);
        }
        Ok(out)
    };
    let ran = compiled.run(&inputs, body);
    t.compiled = compiled;
    let (outs, run) = ran?;
    let line = match run {
        StepRun::Compiled(c) => Some(match &c.report.recompiled_because {
            Some(why) => format!("compiling again: {why}\n{}", c.report),
            None => c.report.to_string(),
        }),
        StepRun::Replayed => None,
    };
    let Some((loss, grads)) = outs.split_first() else {
        return Err(TrainError::Tensor(TensorError::Kernel {
            op: "train --compile",
            detail: "the compiled step gave no loss".into(),
        }));
    };
    for (p, g) in params.iter().zip(grads) {
        p.value().autograd().set_grad(Some(g.clone()));
    }
    let _ng = no_grad();
    Ok((first("train_step", loss)?, line))
}
