//! One pipelined training step of a `PipelineModel` on this rank: its stage's program (from
//! `PipelineSpec::program`: receives, actions and sends, the order `validate` proved to
//! finish) run op by op. Streams and their gradients cross stages with `to_global` between the
//! stages' placements; between disjoint placements that is one-way (boxing's point-to-point
//! strategy: a send that does not wait for the receiver, on a channel of its own per direction
//! on devices), so no stage waits for another's compute except for the data it needs. A
//! receiver takes the messages of one sending stage in the order that stage sent them, keeping
//! the ones it needs later. The tied embedding table goes to the last stage at the start and
//! its gradient comes back at the end. Micro-batch losses are scaled by `1/m` (times
//! the caller's scale, e.g. `1/k` for `k` accumulated runs), so the accumulated gradients are
//! the full batch's; each micro-batch draws its rows of the whole batch's dropout masks
//! (`Pass::micro`), so the step equals the unsplit one. A model whose routers add a
//! load-balancing loss (`PipelineModel::aux_loss`) sends each stream and each gradient with a
//! routing pack beside it (`RouterLog::pack`: the routing sums of every block so far, then the
//! pipeline's totals): the last stage adds the whole loss, every other stage its share's
//! gradient, so loss and gradients are the unsplit micro-batch's.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use oxiflow_collectives::DType;
use oxiflow_sbp::{NdSbp, Shape};
use oxiflow_tensor::{Context, Tensor};

use crate::nn::gpt::RouterLog;
use crate::nn::Pass;
use crate::{Result, TensorError};

use super::model::PipelineModel;
use super::schedule::{Action, HostOp, Message, PipelineSpec};

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
/// gradient goes back), its output (the stream sent on, or the loss), its routers'
/// statistics and, on the last chunk, the routing pack of the whole pipeline.
struct Saved {
    input: Option<Tensor>,
    output: Tensor,
    log: RouterLog,
    totals: Option<Tensor>,
}

/// A message's sending and receiving stages, nd-SBP (the same on both), shape and dtype.
type MessageLayout = (usize, usize, NdSbp, Vec<usize>, DType);

/// What an action computed for the send after it: the message, its tensor and the routing
/// pack that goes with it.
type Produced = (Message, Tensor, Option<Tensor>);

struct Stage<'a> {
    model: &'a dyn PipelineModel,
    spec: PipelineSpec,
    stage: usize,
    /// Messages received (or kept from this stage's own sends) and not used yet.
    stash: HashMap<Message, Tensor>,
    /// The routing packs that came with them.
    packs: HashMap<Message, Tensor>,
    /// The load-balancing loss's coefficient and the routers' experts, when the step adds it.
    aux: Option<(f64, usize)>,
    /// The stream's shape and dtype.
    stream_shape: Vec<usize>,
    stream_dtype: DType,
    waiting: Duration,
}

impl Stage<'_> {
    /// The source and target stages of `msg`, its nd-SBP (the same on both), shape and dtype
    /// (the dtype layers compute with: the tied table's compute copy, the stream's).
    fn layout_of(&self, msg: Message) -> Result<MessageLayout> {
        let pp = self.spec.stages;
        let (to, g) = match msg {
            Message::Activation { to, .. } | Message::Gradient { to, .. } => {
                (self.spec.stage_of(to), to)
            }
            Message::Tied => (pp - 1, 0),
            Message::TiedGradient => (0, 0),
        };
        let from = self.spec.sender_of(msg);
        match msg {
            Message::Tied | Message::TiedGradient => {
                let tied = self
                    .model
                    .tied()
                    .ok_or_else(|| runner_err("the model shares no parameter".into()))?;
                let w = tied.param.value();
                let dtype = tied.param.compute_dtype();
                Ok((from, to, tied.layout, w.shape().dims().to_vec(), dtype))
            }
            _ => {
                let (_, nd) = self
                    .model
                    .stream_layout(g)
                    .ok_or_else(|| runner_err("pipeline stages must be global".into()))?;
                Ok((from, to, nd, self.stream_shape.clone(), self.stream_dtype))
            }
        }
    }

    /// The layout of the routing pack beside `msg` (a stream or its gradient, when the step
    /// adds a load-balancing loss): as `layout_of`, broadcast, f64 `[2 experts + 1]`.
    fn pack_layout(&self, msg: Message) -> Result<Option<MessageLayout>> {
        let (Some((_, experts)), Message::Activation { .. } | Message::Gradient { .. }) =
            (self.aux, msg)
        else {
            return Ok(None);
        };
        let (from, to, _, _, _) = self.layout_of(msg)?;
        let nd = NdSbp::broadcast(self.placement(to)?.ndim());
        Ok(Some((from, to, nd, vec![2 * experts + 1], DType::F64)))
    }

    fn placement(&self, stage: usize) -> Result<oxiflow_placement::Placement> {
        self.model
            .stage_placement(stage)
            .ok_or_else(|| runner_err("pipeline stages must be global".into()))
    }

    /// Sends `t` as `msg` (kept here when this stage receives it itself), and `pack` after
    /// it when the step carries routing packs.
    fn send(&mut self, msg: Message, t: &Tensor, pack: Option<&Tensor>) -> Result<()> {
        let (_, to, nd, _, _) = self.layout_of(msg)?;
        let pack = match (self.pack_layout(msg)?, pack) {
            (Some((_, _, nd, _, _)), Some(p)) => Some((p, nd)),
            (None, None) => None,
            (want, _) => {
                return Err(runner_err(format!(
                    "stage {} sends {msg:?} {} a routing pack",
                    self.stage,
                    if want.is_some() { "without" } else { "with" }
                )))
            }
        };
        if to == self.stage {
            self.stash.insert(msg, t.detach());
            if let Some((p, _)) = pack {
                self.packs.insert(msg, p.detach());
            }
            return Ok(());
        }
        let p = self.placement(to)?;
        t.detach().to_global(&p, nd)?;
        if let Some((t, nd)) = pack {
            t.detach().to_global(&p, nd)?;
        }
        Ok(())
    }

    /// Receives `msg` from its sender (`to_global` from an absent value on the sender's
    /// placement to this stage's) and keeps it.
    fn receive(&mut self, msg: Message) -> Result<()> {
        let (from, to, nd, shape, dtype) = self.layout_of(msg)?;
        if to != self.stage || from == self.stage {
            return Err(runner_err(format!(
                "stage {} receives {msg:?}, which goes from stage {from} to stage {to}",
                self.stage
            )));
        }
        let start = Instant::now();
        let (src, dst) = (self.placement(from)?, self.placement(to)?);
        let absent = Tensor::zeros_global(shape, dtype, &src, nd.clone())?;
        let t = absent.to_global(&dst, nd)?.detach();
        if let Some((_, _, nd, shape, dtype)) = self.pack_layout(msg)? {
            let absent = Tensor::zeros_global(shape, dtype, &src, nd.clone())?;
            self.packs.insert(msg, absent.to_global(&dst, nd)?.detach());
        }
        self.waiting += start.elapsed();
        self.stash.insert(msg, t);
        Ok(())
    }

    /// The routing pack that came with `msg`, when the step carries them.
    fn take_pack(&mut self, msg: Message) -> Result<Option<Tensor>> {
        if self.aux.is_none() {
            return Ok(None);
        }
        self.packs.remove(&msg).map(Some).ok_or_else(|| {
            runner_err(format!(
                "stage {} needs the routing pack of {msg:?} before receiving it",
                self.stage
            ))
        })
    }

    /// The kept tensor of `msg`.
    fn take(&mut self, msg: Message) -> Result<Tensor> {
        self.stash.remove(&msg).ok_or_else(|| {
            runner_err(format!(
                "stage {} needs {msg:?} before receiving it",
                self.stage
            ))
        })
    }
}

/// Opens, before the step's first transfer, the one-way channel of every (sender, receiver)
/// rank pair any message of the step uses, from the same sorted list on every rank: the
/// openings (each meets its peer) cannot wait in a cycle, and no transfer of the step opens a
/// communicator while others are queued on the device (NCCL's creation may wait for the
/// device). Cheap once open (plans and channels are cached).
fn open_channels(st: &Stage<'_>, tied: bool) -> Result<()> {
    let ctx = Context::current()
        .ok_or_else(|| runner_err("no runtime context to open the pipeline's channels".into()))?;
    let mut pairs = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (_, _, msg) in st.spec.messages(tied) {
        let layouts = std::iter::once(st.layout_of(msg)?).chain(st.pack_layout(msg)?);
        for (from, to, nd, shape, dtype) in layouts {
            if !seen.insert((from, to, nd.clone(), shape.clone(), dtype)) {
                continue;
            }
            let (src, dst) = (st.placement(from)?, st.placement(to)?);
            let plan = ctx
                .planner()
                .plan_parts(&Shape::new(shape), (&src, &nd), (&dst, &nd), dtype)
                .map_err(|e| runner_err(format!("planning {msg:?}: {e}")))?;
            pairs.extend(plan.one_way_pairs());
        }
    }
    oxiflow_boxing::open_one_way(ctx.world(), &pairs)
        .map_err(|e| runner_err(format!("opening the pipeline's channels: {e}")))
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
    let mut st = Stage {
        model,
        spec: *spec,
        stage,
        stash: HashMap::new(),
        packs: HashMap::new(),
        aux: model.aux_loss(pass),
        stream_shape,
        stream_dtype,
        waiting: Duration::ZERO,
    };
    let start = Instant::now();
    let tied = if pp > 1 { model.tied() } else { None };
    if pp > 1 {
        open_channels(&st, tied.is_some())?;
    }
    // The first stage's view of the tied table it sends (an exact view, so the returning
    // gradient takes the engine's path into the leaf), and the last stage's copy (a leaf
    // whose gradient goes back at the end).
    let mut tied_sent: Option<Tensor> = None;
    let mut tied_last: Option<Tensor> = None;
    // Each micro-batch draws its rows of the whole batch's dropout masks.
    let pass_of = |mb: usize| pass.micro(mb, m);
    let mut saved: HashMap<(usize, usize), Saved> = HashMap::new();
    let mut losses: Vec<Tensor> = Vec::new();
    // What the last action computed for the `Send` after it.
    let mut outgoing: Option<Produced> = None;
    for op in spec.program(stage, tied.is_some()) {
        match op {
            HostOp::Recv { msg, .. } => {
                st.receive(msg)?;
                match (msg, &tied_sent) {
                    (Message::Tied, _) => {
                        tied_last = Some(st.take(msg)?.requires_grad_(true));
                    }
                    (Message::TiedGradient, Some(view)) => {
                        let dw = st.take(msg)?;
                        view.backward_with(&dw)?;
                    }
                    _ => {}
                }
            }
            HostOp::Send { msg, .. } => {
                let (t, pack) = match (msg, &tied, &tied_last) {
                    (Message::Tied, Some(t), _) => {
                        let w = t.param.compute()?;
                        tied_sent = Some(w.reshape(w.shape().clone())?);
                        (w, None)
                    }
                    (Message::TiedGradient, Some(t), Some(w)) => {
                        let last = st.placement(pp - 1)?;
                        let dw = w.grad().ok_or_else(|| {
                            runner_err("the last stage's tied table has no gradient".into())
                        })?;
                        (dw.to_global(&last, t.layout.clone())?, None)
                    }
                    _ => match outgoing.take() {
                        Some((m, t, pack)) if m == msg => (t, pack),
                        _ => {
                            return Err(runner_err(format!(
                                "stage {stage} sends {msg:?}, which no action computed"
                            )))
                        }
                    },
                };
                st.send(msg, &t, pack.as_ref())?;
            }
            HostOp::Run(a) => {
                let produced = run_action(
                    &mut st,
                    a,
                    batches,
                    &pass_of,
                    tied_last.as_ref(),
                    &mut saved,
                    &mut losses,
                )?;
                if let Some((msg, t, pack)) = produced {
                    match spec.sends(stage, a) {
                        // Kept for this stage's own next chunk.
                        Some((to, _)) if to == stage => st.send(msg, &t, pack.as_ref())?,
                        _ => outgoing = Some((msg, t, pack)),
                    }
                }
            }
        }
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

/// Runs action `a` (virtual stage `g`): a forward from the micro-batch's inputs or the
/// received stream, ending in the loss or the stream it sends on; a backward from the loss or
/// the received gradient, giving the input's gradient to send back. Returns the message it
/// produced, if any.
#[allow(clippy::too_many_arguments)]
fn run_action(
    st: &mut Stage<'_>,
    a: Action,
    batches: &MicroBatches<'_>,
    pass_of: &dyn Fn(usize) -> Pass,
    tied_last: Option<&Tensor>,
    saved: &mut HashMap<(usize, usize), Saved>,
    losses: &mut Vec<Tensor>,
) -> Result<Option<Produced>> {
    let (model, stage) = (st.model, st.stage);
    let chunks = st.spec.chunks();
    let m = st.spec.micro_batches;
    let g = st.spec.virtual_stage(stage, a);
    let stream = |g: usize| {
        model
            .stream_layout(g)
            .ok_or_else(|| runner_err("pipeline stages must be global".into()))
    };
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
            let earlier = match g {
                0 => None,
                _ => st.take_pack(Message::Activation { mb, to: g })?,
            };
            let mut log = RouterLog::default();
            let y = model.run_chunk_routed(g, &x, pass_of(mb), &mut log)?;
            // The routing sums of every block so far (the whole pipeline's after the last).
            let pack = match st.aux {
                Some((_, experts)) => {
                    Some(log.pack(earlier.as_ref(), experts, &st.placement(stage)?)?)
                }
                None => None,
            };
            let (output, produced, totals) = if g + 1 == chunks {
                let mut loss = model.exit_loss(&y, &batches.targets[mb], tied_last, pass_of(mb))?;
                if let (Some((coef, experts)), Some(totals)) = (st.aux, &pack) {
                    if let Some(aux) = log.aux_loss_after(earlier.as_ref(), totals, experts)? {
                        loss = loss.add(&aux.mul_scalar(coef)?.cast(loss.dtype())?)?;
                    }
                }
                losses.push(loss.detach());
                (loss, None, pack)
            } else {
                let (p, nd) = stream(g)?;
                let y = y.to_global(&p, nd)?;
                let msg = Message::Activation { mb, to: g + 1 };
                (y.clone(), Some((msg, y, pack)), None)
            };
            let s = Saved {
                input,
                output,
                log,
                totals,
            };
            saved.insert((mb, chunk), s);
            Ok(produced)
        }
        Action::Backward { mb, chunk } => {
            let s = saved.remove(&(mb, chunk)).ok_or_else(|| {
                runner_err(format!(
                    "stage {stage}: backward of {a:?} before its forward"
                ))
            })?;
            let scale = batches.scale / m as f64;
            let totals = if g + 1 == chunks {
                s.output.mul_scalar(scale)?.backward()?;
                s.totals
            } else {
                let msg = Message::Gradient { mb, to: g };
                let (dy, totals) = (st.take(msg)?, st.take_pack(msg)?);
                // The routers' share of the load-balancing loss, given the pipeline's totals,
                // backpropagates with the stream's gradient in one pass.
                let share = match (st.aux, &totals) {
                    (Some((coef, _)), Some(t)) => s.log.aux_share(t)?.map(|a| (a, coef)),
                    _ => None,
                };
                match share {
                    Some((a, coef)) => {
                        let a = a.mul_scalar(coef * scale)?;
                        let streamed = s.output.mul(&dy)?.sum_all()?;
                        streamed.add(&a.cast(streamed.dtype())?)?.backward()?;
                    }
                    None => s.output.backward_with(&dy)?,
                }
                totals
            };
            let Some(input) = s.input else {
                return Ok(None);
            };
            let dx = input.grad().ok_or_else(|| {
                runner_err(format!("stage {stage}: {a:?} left no input gradient"))
            })?;
            let (p, nd) = stream(g)?;
            Ok(Some((
                Message::Gradient { mb, to: g - 1 },
                dx.to_global(&p, nd)?,
                totals,
            )))
        }
    }
}

/// Gives every trainable parameter this rank holds no piece of an absent zero gradient (no data), so
/// optimizers step (and keep state for) every parameter on every rank alike.
fn absent_grads(model: &dyn PipelineModel) -> Result<()> {
    for p in model.trainable_parameters() {
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
