//! One pipelined training step of a `Gpt` on this rank: its stage's action list (from
//! `PipelineSpec::actions`) run in order. Streams and their gradients cross stages with
//! `to_global` between the stages' placements; between disjoint placements that is a
//! buffered send on the sender and a wait on the receiver, so no stage waits for another's
//! compute except for the data it needs. A receiver takes the messages of one sending stage in
//! the order that stage sent them (it knows the order: the sender's list is a pure function),
//! keeping the ones it needs later. The tied embedding table goes to the last stage at the
//! start and its gradient comes back at the end. Micro-batch losses are scaled by `1/m`, so
//! the accumulated gradients are the full batch's; each micro-batch draws its rows of the whole
//! batch's dropout masks (`Pass::TrainMicro`), so the step equals the unsplit one.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use oxiflow_sbp::NdSbp;
use oxiflow_tensor::Tensor;

use crate::nn::gpt::{Gpt, Pass};
use crate::nn::Module;
use crate::{Result, TensorError};

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
    /// The mean loss over the micro-batches (0-d, on the last stage's placement); None on
    /// other stages.
    pub loss: Option<Tensor>,
    /// Time spent computing (forward, backward, sends), not waiting for a receive.
    pub busy: Duration,
    /// Wall time of the whole schedule.
    pub span: Duration,
}

/// The micro-batches of a step: ids (global, on the first stage) and targets (on the last).
pub struct MicroBatches<'a> {
    pub ids: &'a [Tensor],
    pub targets: &'a [Tensor],
}

/// The tensors one forward keeps for its backward: the stream it received (a leaf whose
/// gradient goes back) and its output (the stream sent on, or the loss).
struct Saved {
    input: Option<Tensor>,
    output: Tensor,
}

struct Stage<'a> {
    model: &'a Gpt,
    spec: PipelineSpec,
    stage: usize,
    /// Per sending stage: the messages still to arrive from it, in its send order.
    expected: HashMap<usize, VecDeque<Message>>,
    /// Messages that arrived (or were sent to this stage by itself) before they were needed.
    stash: HashMap<Message, Tensor>,
    /// `[B/m, T, C]`: the stream's shape.
    stream_shape: Vec<usize>,
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
                let (_, nd) = self
                    .model
                    .tied_layout()
                    .ok_or_else(|| runner_err("the tied table is not global".into()))?;
                let w = self.model.wte.weight.value();
                Ok((from, to, nd, w.shape().dims().to_vec()))
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
            .split
            .layout(stage)
            .placement()
            .cloned()
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
        let dtype = self.model.cfg.dtype;
        let absent = Tensor::zeros_global(shape, dtype, &src, nd.clone())?;
        Ok(absent.to_global(&dst, nd)?.detach())
    }
}

/// Runs this rank's stage `stage` of `spec` on the micro-batches (`spec.micro_batches` of
/// them) and leaves the full batch's gradients in the parameters. Parameters of other stages
/// get absent zero gradients, so every rank's optimizer keeps state for every parameter.
pub fn run_step(
    model: &Gpt,
    spec: &PipelineSpec,
    stage: usize,
    batches: &MicroBatches<'_>,
    pass: Pass,
) -> Result<StepReport> {
    let (pp, m, chunks) = (spec.stages, spec.micro_batches, spec.chunks());
    if model.split.stages() != pp || model.split.chunks() != chunks {
        return Err(runner_err(format!(
            "the model is split into {} stages x {} chunks but the schedule has {pp} x {}",
            model.split.stages(),
            model.split.chunks(),
            spec.virtual_stages
        )));
    }
    if batches.ids.len() != m || batches.targets.len() != m || stage >= pp {
        return Err(runner_err(format!(
            "stage {stage} of {pp} got {} id and {} target micro-batches for {m}",
            batches.ids.len(),
            batches.targets.len()
        )));
    }
    let ids0 = batches.ids[0].shape();
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
        stream_shape: vec![ids0.dim(0), ids0.dim(1), model.cfg.width],
        waiting: Duration::ZERO,
    };
    let start = Instant::now();
    // The tied table: the first stage's compute value, and the last stage's copy (a leaf
    // whose gradient goes back at the end).
    let mut tied_sent = None;
    let mut tied_last = None;
    if pp > 1 && stage == 0 {
        let w = model.wte.weight.compute()?;
        // An exact view, so the returning gradient takes the engine's path into the leaf.
        let view = w.reshape(w.shape().clone())?;
        st.send(Message::Tied, &w)?;
        tied_sent = Some(view);
    }
    if pp > 1 && stage == pp - 1 {
        tied_last = Some(st.take(Message::Tied)?.requires_grad_(true));
    }
    // Each micro-batch draws its rows of the whole batch's dropout masks.
    let pass_of = |mb: usize| match pass {
        Pass::Train { step } if m > 1 => Pass::TrainMicro {
            step,
            index: mb,
            count: m,
        },
        other => other,
    };
    let mut saved: HashMap<(usize, usize), Saved> = HashMap::new();
    let mut losses: Vec<Tensor> = Vec::new();
    for a in spec.actions(stage) {
        let g = spec.virtual_stage(stage, a);
        match a {
            Action::Forward { mb, chunk } => {
                let (input, x) = if g == 0 {
                    let w = model.wte.weight.compute()?;
                    (None, model.embed(&batches.ids[mb], &w, pass_of(mb))?)
                } else {
                    let leaf = st
                        .take(Message::Activation { mb, to: g })?
                        .requires_grad_(true);
                    (Some(leaf.clone()), leaf)
                };
                let y = model.run_chunk(g, &x, pass_of(mb))?;
                let output = if g + 1 == chunks {
                    let w = match &tied_last {
                        Some(w) => w.clone(),
                        None => model.wte.weight.compute()?,
                    };
                    let loss = model.loss_of(&model.head(&y, &w)?, &batches.targets[mb])?;
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
                    s.output.mul_scalar(1.0 / m as f64)?.backward()?;
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
    if let Some(w) = tied_last {
        let (_, nd) = model
            .tied_layout()
            .ok_or_else(|| runner_err("the tied table is not global".into()))?;
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
fn absent_grads(model: &Gpt) -> Result<()> {
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
