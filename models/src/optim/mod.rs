//! Optimizers: `Sgd` (momentum, weight decay) and `AdamW`. State tensors live in each
//! parameter's layout, or its shard under ZeRO ([`Zero`]); the update first boxes the gradient
//! to that layout, so a partial-sum gradient of a broadcast weight is all-reduced there (data
//! parallelism from the algebra) or reduce-scattered into the shard. Updates run under
//! `no_grad` and replace each parameter's leaf. Weight decay is per parameter (decay groups:
//! `with_weight_decay`); `step_with_norm` measures the global gradient norm (`norm`) of the
//! boxed gradients and clips by scaling them inside the update.

/// The `Optimizer` methods every optimizer here writes alike, over its fields `params`,
/// `prepared` (`Prepared`), `zero`, `steps` and `opts.lr`, and its module's `SLOTS`: the
/// prepared gradients, the parameters, the slot names, the ZeRO stage, the step count and
/// the learning rate.
macro_rules! optimizer_bookkeeping {
    () => {
        fn prepare_queued(&mut self) -> $crate::Result<$crate::optim::QueuedSum> {
            self.prepared.prepare(&self.params, self.zero)
        }
        fn prepared_gradients(&self) -> Vec<(usize, oxiflow_tensor::Tensor)> {
            self.prepared.gradients()
        }
        fn params(&self) -> &[$crate::nn::Parameter] {
            &self.params
        }
        fn slot_names(&self) -> &'static [&'static str] {
            SLOTS
        }
        fn zero(&self) -> $crate::optim::Zero {
            self.zero
        }
        fn step_count(&self) -> u64 {
            self.steps
        }
        fn set_step_count(&mut self, n: u64) {
            self.steps = n;
        }
        fn lr(&self) -> f64 {
            self.opts.lr
        }
        fn set_lr(&mut self, lr: f64) {
            self.opts.lr = lr;
        }
    };
}

mod adamw;
mod bucket;
mod norm;
mod sgd;
mod zero;

pub use adamw::{AdamW, AdamWOptions};
pub use bucket::{BucketLaunch, GradBuckets, SyncMode};
pub use norm::{
    clip_factor, clip_ratio, first_non_finite, global_grad_norm, guard_ratio, norm_of,
    queue_sum_of_squares, QueuedSum,
};
pub use sgd::{Sgd, SgdOptions};
pub use zero::{Zero, DEFAULT_GATHER_BYTES};

use crate::nn::Parameter;
use crate::shape_error::pair_shape_err;
use crate::Result;
use oxiflow_tensor::{gather_bucket, gather_fits, no_grad, Tensor};

/// What checkpoints and training loops need from an optimizer.
pub trait Optimizer {
    /// One update of every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;
    /// Boxes every gradient into the layout its state lives in now and queues the sum of
    /// their squares (the squared global L2 norm, the same on every rank), reading nothing;
    /// the parameters' own gradients are cleared. The next `apply` updates from these
    /// gradients, or `discard` drops them.
    fn prepare_queued(&mut self) -> Result<QueuedSum>;
    /// `prepare_queued`, then the norm read (one host synchronisation).
    fn prepare(&mut self) -> Result<f64> {
        Ok(norm_of(self.prepare_queued()?.read()?))
    }
    /// The update from the prepared gradients scaled by `scale` (e.g. a `clip_factor`); an
    /// error without a `prepare` first.
    fn apply(&mut self, scale: f64) -> Result<()>;
    /// The update from the prepared gradients, clipped by `min(r, 1)` for `r` the value of the
    /// device clip ratio `ratio` ([`clip_ratio`]; None: unclipped), queued with nothing read on
    /// the host and kept pending beside the prepared gradients, so the device runs it while
    /// the host still reads the step's loss and norm: [`Optimizer::commit`] makes it the
    /// parameters' values; `apply` and `discard` drop it. Returns false where the optimizer
    /// cannot queue one (nothing is pending; the caller `apply`s as before).
    fn queue_apply(&mut self, _ratio: Option<&Tensor>) -> Result<bool> {
        Ok(false)
    }
    /// Makes the update [`Optimizer::queue_apply`] queued the parameters' values (the same
    /// bits as `apply` with the ratio's clip factor) and drops the prepared gradients; an
    /// error without one.
    fn commit(&mut self) -> Result<()> {
        Err(oxiflow_tensor::TensorError::Kernel {
            op: "Optimizer::commit",
            detail: "no update was queued".into(),
        })
    }
    /// Drops the prepared gradients (and a queued update) without an update (a skipped step).
    fn discard(&mut self);
    /// The gradients `prepare` boxed, with their parameters' indices (empty when none are
    /// prepared): what a health check inspects before `apply` or `discard`.
    fn prepared_gradients(&self) -> Vec<(usize, Tensor)>;
    /// `prepare`, then `apply` with the gradients clipped to a global norm of `max_norm`
    /// (None: unclipped), as torch's `clip_grad_norm_` then `step`; returns the norm before
    /// clipping. [`Optimizer::step_queued`], then the norm read: the update is queued and
    /// made the parameters' values before the host waits for the device.
    fn step_with_norm(&mut self, max_norm: Option<f64>) -> Result<f64> {
        self.step_queued(max_norm)?.read()
    }
    /// [`Optimizer::step_with_norm`] with nothing read on the host where the optimizer can
    /// queue the update ([`Optimizer::queue_clipped`]): the norm stays on the device until
    /// [`StepNorm::read`], so a loop that does not read it never waits for the device. The
    /// same bits as `step_with_norm` for any norm: a queued update is committed whatever the
    /// norm, since a non-finite norm's device clip ratio is NaN, as `clip_factor` is then.
    fn step_queued(&mut self, max_norm: Option<f64>) -> Result<StepNorm> {
        let sum = self.prepare_queued()?;
        if let Some(ratio) = device_clip_ratio(&sum, max_norm)? {
            if self.apply_queued_now(ratio.as_ref())? {
                return Ok(StepNorm::Queued(sum));
            }
        }
        let norm = norm_of(sum.read()?);
        self.apply(clip_factor(norm, max_norm))?;
        Ok(StepNorm::Read(norm))
    }
    /// [`Optimizer::queue_apply`] clipped to a global norm of `max_norm` (None: unclipped) by
    /// the device clip ratio of the prepared gradients' queued sum of squares `sum`; false
    /// where nothing was queued (the ratio needs the host, or the optimizer cannot queue). A
    /// queued update equals `apply(clip_factor(norm, max_norm))`.
    fn queue_clipped(&mut self, sum: &QueuedSum, max_norm: Option<f64>) -> Result<bool> {
        match device_clip_ratio(sum, max_norm)? {
            Some(ratio) => self.queue_apply(ratio.as_ref()),
            None => Ok(false),
        }
    }
    /// [`Optimizer::queue_apply`], then [`Optimizer::commit`]: the update is the parameters'
    /// values at once (nothing to drop), so an optimizer may write it over the old values'
    /// memory where nothing else holds it, as torch's in-place update does (AdamW on CUDA:
    /// no second copy of the parameters and state). False where nothing was queued.
    fn apply_queued_now(&mut self, ratio: Option<&Tensor>) -> Result<bool> {
        if !self.queue_apply(ratio)? {
            return Ok(false);
        }
        self.commit()?;
        Ok(true)
    }
    /// The update from the prepared gradients clipped by `min(r, 1)`, `r` the value of the
    /// device ratio `ratio` ([`guard_ratio`]), where a NaN `r` leaves the parameters and state
    /// as they were: the step skipped on the device, with nothing read on the host (the step
    /// count advances either way; a loop that learns of the skip sets it back). Made the
    /// values at once, so written over the old memory where an optimizer can, as
    /// [`Optimizer::apply_queued_now`]; the prepared gradients stay for inspection
    /// (`prepared_gradients`) until `discard`. False where the optimizer cannot (nothing
    /// done; the prepared gradients stay for `queue_apply` or `apply`).
    fn apply_guarded_now(&mut self, _ratio: &Tensor) -> Result<bool> {
        Ok(false)
    }
    /// The parameters, in order.
    fn params(&self) -> &[Parameter];
    /// Names of the per-parameter state slots (e.g. `exp_avg`).
    fn slot_names(&self) -> &'static [&'static str];
    /// State slot `slot` of parameter `index` (None before the first step).
    fn state(&self, index: usize, slot: &str) -> Option<Tensor>;
    /// Sets a state slot (a checkpoint load); `t` must have the parameter's layout.
    fn set_state(&mut self, index: usize, slot: &str, t: Tensor) -> Result<()>;
    /// How far state, gradients and parameters are sharded over the data-parallel axis.
    fn zero(&self) -> Zero {
        Zero::OFF
    }
    /// Number of steps taken.
    fn step_count(&self) -> u64;
    fn set_step_count(&mut self, n: u64);
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);
    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.params() {
            p.zero_grad();
        }
    }
}

/// The device clip ratio clipping to a global norm of `max_norm` by the queued sum of squares
/// `sum`: Some(None) unclipped, Some(Some(r)) clipped by `r`, None where the ratio needs the
/// host.
fn device_clip_ratio(sum: &QueuedSum, max_norm: Option<f64>) -> Result<Option<Option<Tensor>>> {
    match max_norm {
        None => Ok(Some(None)),
        Some(m) => Ok(clip_ratio(sum, m)?.map(Some)),
    }
}

/// A parameter as the optimizer updates it: the leaf and its gradient in the state's layout
/// (the leaf's own, or its ZeRO shard).
pub(crate) struct Update {
    pub value: Tensor,
    pub grad: Tensor,
}

/// The global gradient norm of a step taken by [`Optimizer::step_queued`].
#[derive(Debug)]
pub enum StepNorm {
    /// Still on the device: the gradients' queued sum of squares.
    Queued(QueuedSum),
    /// Read on the host already (the update needed it).
    Read(f64),
}

impl StepNorm {
    /// The norm (for a queued one, one host synchronisation; every rank reads the same).
    pub fn read(&self) -> Result<f64> {
        match self {
            StepNorm::Queued(sum) => Ok(norm_of(sum.read()?)),
            StepNorm::Read(n) => Ok(*n),
        }
    }
}

/// The update views of every parameter (None: no gradient), boxed now, with their gradients'
/// queued sum of squares; each parameter's own gradient is cleared once its view holds the
/// boxed copy.
fn prepare_updates(params: &[Parameter], zero: Zero) -> Result<(Vec<Option<Update>>, QueuedSum)> {
    let mut views = Vec::with_capacity(params.len());
    for p in params {
        let v = update_view(p, zero)?;
        if v.is_some() {
            p.zero_grad();
        }
        views.push(v);
    }
    let grads: Vec<Tensor> = views.iter().flatten().map(|u| u.grad.clone()).collect();
    let sum = queue_sum_of_squares(&grads)?;
    Ok((views, sum))
}

/// Gradients `prepare` boxed into their states' layouts, kept for the next `apply`.
#[derive(Default)]
pub(crate) struct Prepared(Option<Vec<Option<Update>>>);

impl Prepared {
    /// Boxes `params`' gradients (see `prepare_updates`); returns their queued sum of
    /// squares.
    pub(crate) fn prepare(&mut self, params: &[Parameter], zero: Zero) -> Result<QueuedSum> {
        let _ng = no_grad();
        let (views, sum) = prepare_updates(params, zero)?;
        self.0 = Some(views);
        Ok(sum)
    }
    /// The prepared views with their parameters' indices (an error without a `prepare`).
    pub(crate) fn take(&mut self, op: &'static str) -> Result<Vec<(usize, Update)>> {
        let views = self.0.take().ok_or(oxiflow_tensor::TensorError::Kernel {
            op,
            detail: "apply without prepare: no gradients were prepared".into(),
        })?;
        Ok(views
            .into_iter()
            .enumerate()
            .filter_map(|(i, u)| Some((i, u?)))
            .collect())
    }
    pub(crate) fn discard(&mut self) {
        self.0 = None;
    }
    /// The prepared views with their parameters' indices, kept for a later `take` (an error
    /// without a `prepare`).
    pub(crate) fn views(&self, op: &'static str) -> Result<Vec<(usize, &Update)>> {
        let views = self.0.as_ref().ok_or(oxiflow_tensor::TensorError::Kernel {
            op,
            detail: "no gradients were prepared".into(),
        })?;
        Ok(views
            .iter()
            .enumerate()
            .filter_map(|(i, u)| Some((i, u.as_ref()?)))
            .collect())
    }
    /// The prepared gradients with their parameters' indices (empty without a `prepare`).
    pub(crate) fn gradients(&self) -> Vec<(usize, Tensor)> {
        self.0
            .iter()
            .flatten()
            .enumerate()
            .filter_map(|(i, u)| Some((i, u.as_ref()?.grad.clone())))
            .collect()
    }
}

/// Per-parameter weight decay: `per_param` (one value per parameter, each finite and >= 0).
pub(crate) fn check_decay(op: &'static str, params: &[Parameter], per_param: &[f64]) -> Result<()> {
    if per_param.len() != params.len() {
        return Err(oxiflow_tensor::TensorError::Kernel {
            op,
            detail: format!(
                "{} weight-decay values for {} parameters",
                per_param.len(),
                params.len()
            ),
        });
    }
    if let Some((p, d)) = params
        .iter()
        .zip(per_param)
        .find(|(_, d)| !(d.is_finite() && **d >= 0.0))
    {
        return Err(oxiflow_tensor::TensorError::Kernel {
            op,
            detail: format!(
                "weight decay {d} of {} is not a finite value >= 0",
                p.name()
            ),
        });
    }
    Ok(())
}

/// The update view of `p`, or None when it has no gradient.
pub(crate) fn update_view(p: &Parameter, zero: Zero) -> Result<Option<Update>> {
    let _ng = no_grad();
    let leaf = p.value();
    let Some(g) = leaf.grad() else {
        return Ok(None);
    };
    let (Some(pl), Some(own)) = (leaf.placement(), leaf.nd_sbp()) else {
        return Ok(Some(Update {
            value: leaf.clone(),
            grad: g,
        }));
    };
    let target = zero.shard_layout(&leaf).unwrap_or_else(|| own.clone());
    Ok(Some(Update {
        value: leaf.to_global(pl, target.clone())?,
        grad: g.to_global(pl, target)?,
    }))
}

/// Writes an updated value (in the state's layout) back as `p`'s new leaf, all-gathering a
/// shard into the leaf's layout.
pub(crate) fn write_back(p: &Parameter, new: &Tensor) -> Result<()> {
    let _ng = no_grad();
    let leaf = p.value();
    let new = match (leaf.placement(), leaf.nd_sbp()) {
        (Some(pl), Some(own)) if new.nd_sbp() != Some(own) => new.to_global(pl, own.clone())?,
        _ => new.clone(),
    };
    p.set_value(&new)
}

/// Writes each updated value `news` (parameter index, value in the state's layout) back as its
/// parameter's new leaf, as [`write_back`] does one at a time, except that the shards of
/// ZeRO-1/2 updates are gathered in buckets of at least `zero.gather_bytes()` per dtype and
/// placement, in the given order (one all-gather each, [`gather_bucket`]); a shard no bucket
/// can take is gathered alone. Then every master shard's new compute copy is gathered
/// (`Parameter::ensure_gathered`), in parameter order.
pub(crate) fn write_back_all(
    params: &[Parameter],
    news: Vec<(usize, Tensor)>,
    zero: Zero,
) -> Result<()> {
    let _ng = no_grad();
    let cap = zero.gather_bytes();
    // Open buckets: (the parameters and their shards, bytes).
    let mut open: Vec<(Vec<(usize, Tensor)>, usize)> = Vec::new();
    let gather = |bucket: Vec<(usize, Tensor)>| -> Result<()> {
        let shards: Vec<Tensor> = bucket.iter().map(|(_, t)| t.clone()).collect();
        for ((i, _), full) in bucket.iter().zip(gather_bucket(&shards, zero.axis())?) {
            params[*i].set_value(&full)?;
        }
        Ok(())
    };
    for (i, new) in news {
        // A ZeRO-1/2 update is in its leaf's shard layout (stage 3 stores the leaf sharded, so
        // its update is already in the leaf's layout and has no shard layout).
        let bucketed = cap > 0
            && zero
                .shard_layout(&params[i].value())
                .is_some_and(|shard| new.nd_sbp() == Some(&shard))
            && gather_fits(&new, zero.axis());
        if !bucketed {
            write_back(&params[i], &new)?;
            continue;
        }
        let bytes = new.numel() * new.dtype().size();
        let at = match open.iter().position(|(b, _)| {
            b[0].1.dtype() == new.dtype() && b[0].1.placement() == new.placement()
        }) {
            Some(at) => at,
            None => {
                open.push((Vec::new(), 0));
                open.len() - 1
            }
        };
        open[at].0.push((i, new));
        open[at].1 += bytes;
        if open[at].1 >= cap {
            gather(open.remove(at).0)?;
        }
    }
    for (bucket, _) in open {
        gather(bucket)?;
    }
    // Master shards (ZeRO-2 under mixed precision): their new compute copies, gathered now so
    // the gathers run under the host's work between steps and the next forward pass waits
    // only where it first reads each.
    for p in params {
        p.ensure_gathered()?;
    }
    Ok(())
}

/// A state tensor (e.g. from a checkpoint, in any layout of the parameter's placement) boxed
/// to the layout the optimizer keeps state `slot` of `p` in; checks shape, dtype and placement.
pub(crate) fn state_in_layout(
    op: &'static str,
    p: &Parameter,
    zero: Zero,
    slot: &str,
    t: &Tensor,
) -> Result<Tensor> {
    check_state(op, p, slot, t)?;
    let _ng = no_grad();
    let v = p.value();
    Ok(match (v.placement(), v.nd_sbp()) {
        (Some(pl), Some(own)) => {
            let target = zero.shard_layout(&v).unwrap_or_else(|| own.clone());
            t.to_global(pl, target)?.detach()
        }
        _ => t.detach(),
    })
}

/// Checks that a state tensor has the parameter's shape, dtype and placement.
fn check_state(op: &'static str, p: &Parameter, slot: &str, t: &Tensor) -> Result<()> {
    let v = p.value();
    if t.shape() != v.shape() || t.dtype() != v.dtype() || t.placement() != v.placement() {
        return Err(pair_shape_err(
            op,
            &v,
            t,
            format!(
                "state {slot} of {} must be {} but is {}",
                p.name(),
                v.describe(),
                t.describe()
            ),
        ));
    }
    Ok(())
}
