//! One pipelined training step of a `PipelineModel` on this rank: its stage's action list (from
//! `PipelineSpec::actions`) run in order. Streams and their gradients cross stages with
//! `to_global` between the stages' placements; between disjoint placements that is a
//! buffered send on the sender and a wait on the receiver, so no stage waits for another's
//! compute except for the data it needs. A receiver takes the messages of one sending stage in
//! the order that stage sent them (it knows the order: the sender's list is a pure function),
//! keeping the ones it needs later. The tied embedding table goes to the last stage at the
//! start and its gradient comes back at the end. Micro-batch losses are scaled by `1/m` (times
//! the caller's scale, e.g. `1/k` for `k` accumulated runs), so the accumulated gradients are
//! the full batch's; each micro-batch draws its rows of the whole batch's dropout masks
//! (`Pass::micro`), so the step equals the unsplit one.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use oxiflow_sbp::NdSbp;
use oxiflow_tensor::Tensor;

use crate::nn::Pass;
use crate::{Result, TensorError};

use super::model::PipelineModel;
use super::schedule::{Action, Message, PipelineSpec};

fn runner_err(detail: String) -> TensorError {
    TensorError::Autograd {
        op: "pipeline step",
        detail,
    }
}

/// What one step did on this rank.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// The mean loss over the micro-batches (0-d, on the last stage's placement, not scaled);
    /// None on other stages.
    pub loss: Option<Tensor>,
    /// Time spent computing (forward, backward, sends), not waiting for a receive.
    pub busy: Duration,
    /// Wall time of the whole schedule.
    pub span: Duration,
}

/// The micro-batches of a step: inputs (global, on the first stage) and targets (on the last),
/// and the factor each micro-batch's mean loss is scaled by on top of `1/m` before its backward
/// pass (1 for a whole step; `1/k` when the step accumulates `k` such runs).
pub struct MicroBatches<'a> {
    pub inputs: &'a [Tensor],
    pub targets: &'a [Tensor],
    pub scale: f64,
}

/// The tensors one forward keeps for its backward: the stream it received (a leaf whose
/// gradient goes back) and its output (the stream sent on, or the loss).
struct Saved {
    input: Option<Tensor>,
    output: Tensor,
}

struct Stage<'a> {
    model: &'a dyn PipelineModel,
    spec: PipelineSpec,
    stage: usize,
    /// Per sending stage: the messages still to arrive from it, in its send order.
    expected: HashMap<usize, VecDeque<Message>>,
    /// Messages that arrived (or were sent to this stage by itself) before they were needed.
    stash: HashMap<Message, Tensor>,
    /// The stream's shape and dtype.
    stream_shape: Vec<usize>,
    stream_dtype: oxiflow_collectives::DType,
    waiting: Duration,
}

impl Stage<'_> {
    /// The placement and nd-SBP of `msg` on the stage that receives it, and its source stage.
    fn layout_of(&self, msg: Message) -> Result<(usize, usize, NdSbp, Vec<usize>)> {
        let pp = self.spec.stages;
        let (from, to, g) = match msg {
            Message::Activation { to, .. } => (
                self.spec.stage_of(to.saturating_sub(1)),
                self.spec.stage_of(to),
                to,
            ),
            Message::Gradient { to, .. } => {
                (self.spec.stage_of(to + 1), self.spec.stage_of(to), to)
            }
            Message::Tied => (0, pp - 1, 0),
            Message::TiedGradient => (pp - 1, 0, 0),
        };
        match msg {
            Message::Tied | Message::TiedGradient => {
                let tied = self
                    .model
                    .tied()
                    .ok_or_else(|| runner_err("the model shares no parameter".into()))?;
                let w = tied.param.value();
                Ok((from, to, tied.layout, w.shape().dims().to_vec()))
            }
            _ => {
                let (_, nd) = self
                    .model
                    .stream_layout(g)
                    .ok_or_else(|| runner_err("pipeline stages must be global".into()))?;
                Ok((from, to, nd, self.stream_shape.clone()))
            }
        }
    }

    fn placement(&self, stage: usize) -> Result<oxiflow_placement::Placement> {
        self.model
            .stage_placement(stage)
            .ok_or_else(|| runner_err("pipeline stages must be global".into()))
    }

    /// Sends `t` as `msg` (kept here when this stage receives it itself).
    fn send(&mut self, msg: Message, t: &Tensor) -> Result<()> {
        let (_, to, nd, _) = self.layout_of(msg)?;
        if to == self.stage {
            self.stash.insert(msg, t.detach());
            return Ok(());
        }
        let p = self.placement(to)?;
        t.detach().to_global(&p, nd)?;
        Ok(())
    }

    /// The tensor of `msg`, receiving (and keeping) earlier messages of its sender first.
    fn take(&mut self, msg: Message) -> Result<Tensor> {
        if let Some(t) = self.stash.remove(&msg) {
            return Ok(t);
        }
        let (from, to, _, _) = self.layout_of(msg)?;
        if to != self.stage || from == self.stage {
            return Err(runner_err(format!(
                "stage {} waits for {msg:?}, which it never receives",
                self.stage
            )));
        }
        let start = Instant::now();
        loop {
            let next = self
                .expected
                .get_mut(&from)
                .and_then(VecDeque::pop_front)
                .ok_or_else(|| {
                    runner_err(format!(
                        "stage {} waits for {msg:?} but stage {from} sends nothing more",
                        self.stage
                    ))
                })?;
            let t = self.receive(next)?;
            if next == msg {
                self.waiting += start.elapsed();
                return Ok(t);
            }
            self.stash.insert(next, t);
        }
    }

    /// Receives `msg` from its sender: `to_global` from (an absent value on) the sender's
    /// placement to this stage's.
    fn receive(&self, msg: Message) -> Result<Tensor> {
        let (from, to, nd, shape) = self.layout_of(msg)?;
        let (src, dst) = (self.placement(from)?, self.placement(to)?);
        let dtype = self.stream_dtype;
        let absent = Tensor::zeros_global(shape, dtype, &src, nd.clone())?;
        Ok(absent.to_global(&dst, nd)?.detach())
    }
}

/// Runs this rank's stage `stage` of `spec` on the micro-batches (`spec.micro_batches` of
/// them) and adds the full batch's gradients (times `batches.scale`) to the parameters'.
/// `pass` is the pass of the whole batch (micro-batch `j` trains as `pass.micro(j, m)`).
/// Parameters of other stages get absent zero gradients, so every rank's optimizer keeps
/// state for every parameter.
pub fn run_step(
    model: &dyn PipelineModel,
    spec: &PipelineSpec,
    stage: usize,
    batches: &MicroBatches<'_>,
    pass: Pass,
) -> Result<StepReport> {
    let (pp, m, chunks) = (spec.stages, spec.micro_batches, spec.chunks());
    if model.stages() != pp || model.chunks() != chunks {
        return Err(runner_err(format!(
            "the model is split into {} stages x {} chunks but the schedule has {pp} x {}",
            model.stages(),
            model.chunks(),
            spec.virtual_stages
        )));
    }
    if batches.inputs.len() != m || batches.targets.len() != m || stage >= pp {
        return Err(runner_err(format!(
            "stage {stage} of {pp} got {} input and {} target micro-batches for {m}",
            batches.inputs.len(),
            batches.targets.len()
        )));
    }
    if !batches.scale.is_finite() {
        return Err(runner_err(format!(
            "loss scale {} is not finite",
            batches.scale
        )));
    }
    let (stream_shape, stream_dtype) = model.stream_meta(&batches.inputs[0]);
    let mut expected: HashMap<usize, VecDeque<Message>> = HashMap::new();
    for from in (0..pp).filter(|&s| s != stage) {
        let q = spec
            .outbox(from)
            .into_iter()
            .filter(|&(to, _)| to == stage)
            .map(|(_, msg)| msg)
            .collect();
        expected.insert(from, q);
    }
    let mut st = Stage {
        model,
        spec: *spec,
        stage,
        expected,
        stash: HashMap::new(),
        stream_shape,
        stream_dtype,
        waiting: Duration::ZERO,
    };
    let start = Instant::now();
    // The tied table: the first stage's compute value, and the last stage's copy (a leaf
    // whose gradient goes back at the end).
    let tied = if pp > 1 { model.tied() } else { None };
    let mut tied_sent = None;
    let mut tied_last = None;
    if let (Some(t), 0) = (&tied, stage) {
        let w = t.param.compute()?;
        // An exact view, so the returning gradient takes the engine's path into the leaf.
        let view = w.reshape(w.shape().clone())?;
        st.send(Message::Tied, &w)?;
        tied_sent = Some(view);
    }
    if tied.is_some() && stage == pp - 1 {
        tied_last = Some(st.take(Message::Tied)?.requires_grad_(true));
    }
    // Each micro-batch draws its rows of the whole batch's dropout masks.
    let pass_of = |mb: usize| pass.micro(mb, m);
    let mut saved: HashMap<(usize, usize), Saved> = HashMap::new();
    let mut losses: Vec<Tensor> = Vec::new();
    for a in spec.actions(stage) {
        let g = spec.virtual_stage(stage, a);
        match a {
            Action::Forward { mb, chunk } => {
                let (input, x) = if g == 0 {
                    (None, model.enter(&batches.inputs[mb], pass_of(mb))?)
                } else {
                    let leaf = st
                        .take(Message::Activation { mb, to: g })?
                        .requires_grad_(true);
                    (Some(leaf.clone()), leaf)
                };
                let y = model.run_chunk(g, &x, pass_of(mb))?;
                let output = if g + 1 == chunks {
                    let loss = model.exit_loss(
                        &y,
                        &batches.targets[mb],
                        tied_last.as_ref(),
                        pass_of(mb),
                    )?;
                    losses.push(loss.detach());
                    loss
                } else {
                    let (p, nd) = model
                        .stream_layout(g)
                        .ok_or_else(|| runner_err("pipeline stages must be global".into()))?;
                    let y = y.to_global(&p, nd)?;
                    st.send(Message::Activation { mb, to: g + 1 }, &y)?;
                    y
                };
                saved.insert((mb, chunk), Saved { input, output });
            }
            Action::Backward { mb, chunk } => {
                let s = saved.remove(&(mb, chunk)).ok_or_else(|| {
                    runner_err(format!(
                        "stage {stage}: backward of {a:?} before its forward"
                    ))
                })?;
                if g + 1 == chunks {
                    s.output.mul_scalar(batches.scale / m as f64)?.backward()?;
                } else {
                    let dy = st.take(Message::Gradient { mb, to: g })?;
                    s.output.backward_with(&dy)?;
                }
                if let Some(input) = s.input {
                    let dx = input.grad().ok_or_else(|| {
                        runner_err(format!("stage {stage}: {a:?} left no input gradient"))
                    })?;
                    let (p, nd) = model
                        .stream_layout(g)
                        .ok_or_else(|| runner_err("pipeline stages must be global".into()))?;
                    st.send(Message::Gradient { mb, to: g - 1 }, &dx.to_global(&p, nd)?)?;
                }
            }
        }
    }
    if let (Some(w), Some(t)) = (tied_last, &tied) {
        let nd = t.layout.clone();
        let last = st.placement(pp - 1)?;
        let dw = w
            .grad()
            .ok_or_else(|| runner_err("the last stage's tied table has no gradient".into()))?;
        st.send(Message::TiedGradient, &dw.to_global(&last, nd)?)?;
    }
    if let Some(view) = tied_sent {
        let dw = st.take(Message::TiedGradient)?;
        view.backward_with(&dw)?;
    }
    let span = start.elapsed();
    let loss = match losses.split_first() {
        Some((first, rest)) => {
            let mut sum = first.clone();
            for l in rest {
                sum = sum.add(l)?;
            }
            Some(sum.mul_scalar(1.0 / m as f64)?)
        }
        None => None,
    };
    absent_grads(model)?;
    Ok(StepReport {
        loss,
        busy: span.saturating_sub(st.waiting),
        span,
    })
}

/// Gives every parameter this rank holds no piece of an absent zero gradient (no data), so
/// optimizers step (and keep state for) every parameter on every rank alike.
fn absent_grads(model: &dyn PipelineModel) -> Result<()> {
    for p in model.parameters() {
        let v = p.value();
        let (Some(pl), Some(nd), Some(ctx)) = (v.placement(), v.nd_sbp(), v.context()) else {
            continue;
        };
        if pl.contains(ctx.rank()) || v.grad().is_some() {
            continue;
        }
        let z = Tensor::zeros_global(v.shape().clone(), v.dtype(), pl, nd.clone())?;
        v.backward_with(&z)?;
    }
    Ok(())
}
