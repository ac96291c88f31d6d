//! AdamW (decoupled weight decay), as torch.optim.AdamW:
//! p *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//! p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
//! `wd` is per parameter (`with_weight_decay`); a clipped step uses `c g` for `g`, folded
//! into the moments' coefficients. A step updates every parameter with one multi-tensor op
//! (one device launch on CUDA) on each rank's pieces, whatever their layouts. A parameter
//! computed in another dtype (mixed precision) whose state lives in its leaf's own layout gets
//! its compute copy written by the same op, so its next forward pass casts nothing. An update
//! clipped by a device clip ratio can be queued before the host reads anything and committed
//! (or dropped) after (`queue_apply`, `commit`). An update that is the parameters' values at
//! once (`step`, `apply`, `apply_queued_now`) writes the new values, moments and compute
//! copies over the old ones (`AdamWReuse`) where nothing else holds them
//! (`Parameter::leaf_memory_free_for`, `Tensor::data_held_only_by`): no second copy of the
//! model's state, and a compiled step's device graph reads the same pieces every launch.

use crate::nn::Parameter;
use crate::{Result, TensorError};
use oxiflow_dtype::DType;
use oxiflow_ops::adamw::{
    adamw_multi_by, AdamWClip, AdamWHyper, AdamWReuse, AdamWSlot, AdamWUpdated,
};
use oxiflow_tensor::Tensor;
use oxiflow_tensor::{no_grad, Device};

use super::{
    check_decay, state_in_layout, update_view, write_back_all, Optimizer, Prepared, Update, Zero,
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWOptions {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWOptions {
    fn default() -> Self {
        AdamWOptions {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW; both moment estimates live in the parameter's layout, or its shard under ZeRO.
pub struct AdamW {
    params: Vec<Parameter>,
    opts: AdamWOptions,
    /// Weight decay of each parameter (`opts.weight_decay` unless set per parameter).
    decay: Vec<f64>,
    /// Gradients boxed by `prepare`, for the next `apply`.
    prepared: Prepared,
    zero: Zero,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    steps: u64,
    /// An update `queue_apply` queued: each parameter's index and new values.
    pending: Option<Vec<(usize, AdamWUpdated)>>,
    /// Parameters the last update wrote over their old values' memory.
    in_place: usize,
    /// Whether updates may write over the old values' memory (`with_in_place_update`).
    in_place_allowed: bool,
}

impl AdamW {
    pub fn new(params: Vec<Parameter>, opts: AdamWOptions) -> AdamW {
        let n = params.len();
        AdamW {
            decay: vec![opts.weight_decay; n],
            prepared: Prepared::default(),
            params,
            opts,
            zero: Zero::OFF,
            m: vec![None; n],
            v: vec![None; n],
            steps: 0,
            pending: None,
            in_place: 0,
            in_place_allowed: true,
        }
    }

    /// Shards state (and gradients, parameters) as `zero` says; see [`Zero::prepare`].
    pub fn with_zero(mut self, zero: Zero) -> Result<AdamW> {
        zero.prepare(&self.params)?;
        self.zero = zero;
        Ok(self)
    }

    /// Whether an update applied at once may be written over the old values' memory where
    /// nothing else holds it (the default), or always into new memory (the same bits, and a
    /// second copy of the state while it runs).
    pub fn with_in_place_update(mut self, on: bool) -> AdamW {
        self.in_place_allowed = on;
        self
    }

    /// Decays parameter `i` by `per_param[i]` (decay groups: e.g. 0 for biases, norms and
    /// embeddings); one finite value >= 0 per parameter.
    pub fn with_weight_decay(mut self, per_param: Vec<f64>) -> Result<AdamW> {
        check_decay("AdamW::with_weight_decay", &self.params, &per_param)?;
        self.decay = per_param;
        Ok(self)
    }

    /// One update of the parameters `ups` (index and update view) with gradients scaled by
    /// `c`, written back at once (see [`AdamW::run_update`]), over the old values' memory
    /// where nothing else holds it; each other old compute copy's memory goes back before the
    /// op writes the new one.
    fn update_all(&mut self, ups: Vec<(usize, Update)>, c: f64) -> Result<()> {
        let views: Vec<(usize, &Update)> = ups.iter().map(|(i, u)| (*i, u)).collect();
        let updated = self.run_update(&views, c, AdamWClip::Host, true)?;
        self.in_place = in_place_count(&views, &updated);
        self.write_updates(updated)
    }

    /// The update from the prepared gradients, clipped as `clip` says, made the values at
    /// once (in place where it can be); `keep` leaves the prepared gradients for inspection.
    fn apply_now(&mut self, clip: AdamWClip<'_>, keep: bool) -> Result<bool> {
        let _ng = no_grad();
        self.pending = None;
        let views = self.prepared.views("AdamW::apply_now")?;
        let updated = self.run_update(&views, 1.0, clip, true)?;
        self.in_place = in_place_count(&views, &updated);
        self.write_updates(updated)?;
        if !keep {
            self.prepared.discard();
        }
        self.steps += 1;
        Ok(true)
    }

    /// How many parameters the last update wrote over their old values' memory (on CUDA,
    /// where nothing else held it; see [`Optimizer::apply_queued_now`]).
    pub fn updated_in_place(&self) -> usize {
        self.in_place
    }

    /// Whether parameter `i`'s update may be written over its old value, moments and compute
    /// copy (`view` its update view): nothing but this optimizer and the parameter holds them
    /// (moments not made yet, before the first step, are zeros the update makes itself, so the
    /// first step holds no second copy of the parameters and their moments either). Returns
    /// the old compute copy to write over (None: the new one goes to new memory), or None where
    /// the update may not.
    fn reusable(&self, i: usize, view: &Update, copy: bool) -> Option<Option<Tensor>> {
        let own = |t: &Option<Tensor>| t.as_ref().is_none_or(|t| Tensor::data_held_only_by(&[t]));
        let p = &self.params[i];
        if view.value.device() == Device::Cpu
            || oxiflow_tensor::capture::capturing()
            || !self.in_place_allowed
        {
            // The host and a capture write new memory (`AdamWReuse`).
            return None;
        }
        if !(own(&self.m[i]) && own(&self.v[i]) && p.leaf_memory_free_for(&view.value)) {
            return None;
        }
        Some(copy.then(|| p.copy_memory_free()).flatten())
    }

    /// The new values of the parameters `ups` (index and update view) with gradients scaled
    /// by `c` and clipped as `clip` says (by a device ratio, or guarded by one): one
    /// multi-tensor op over this rank's pieces of them all (see `oxiflow_ops::adamw::adamw_multi`), with
    /// each compute copy where the update runs in its leaf's layout (a ZeRO-1/2 shard of a
    /// whole leaf is gathered in f32 and cast by the next forward pass; a master shard's copy
    /// is written here and gathered). Nothing is written back. With `in_place`, the new values
    /// are written over the old ones' memory where nothing else holds it (`AdamWReuse`); the
    /// old compute copies not written over are dropped first, so their memory goes back
    /// before the op writes the new ones.
    fn run_update(
        &self,
        ups: &[(usize, &Update)],
        c: f64,
        clip: AdamWClip<'_>,
        in_place: bool,
    ) -> Result<Vec<(usize, AdamWUpdated)>> {
        let o = self.opts;
        let hyper = AdamWHyper {
            lr: o.lr,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            step: self.steps + 1,
            grad_scale: c,
        };
        let copies: Vec<Option<DType>> = ups
            .iter()
            .map(|&(i, u)| {
                let p = &self.params[i];
                let (leaf, d) = (p.value(), p.compute_dtype());
                (d != leaf.dtype() && u.value.layout() == leaf.layout()).then_some(d)
            })
            .collect();
        let reuse: Vec<Option<Option<Tensor>>> = ups
            .iter()
            .zip(&copies)
            .map(|(&(i, u), d)| in_place.then(|| self.reusable(i, u, d.is_some())).flatten())
            .collect();
        if in_place {
            for ((i, _), r) in ups.iter().zip(&reuse) {
                if !matches!(r, Some(Some(_))) {
                    self.params[*i].drop_copy();
                }
            }
        }
        let slots: Vec<AdamWSlot> = ups
            .iter()
            .zip(&copies)
            .zip(&reuse)
            .map(|((&(i, u), &compute_copy), r)| AdamWSlot {
                param: &u.value,
                grad: &u.grad,
                m: self.m[i].as_ref(),
                v: self.v[i].as_ref(),
                weight_decay: self.decay[i],
                compute_copy,
                reuse: r.as_ref().map(|copy| AdamWReuse {
                    copy: copy.as_ref(),
                }),
            })
            .collect();
        let updated = adamw_multi_by(&slots, &hyper, clip)?;
        Ok(ups.iter().map(|(i, _)| *i).zip(updated).collect())
    }

    /// Each new value written back to its leaf's layout, with its compute copy, and the new
    /// moments kept.
    fn write_updates(&mut self, updated: Vec<(usize, AdamWUpdated)>) -> Result<()> {
        let mut news = Vec::with_capacity(updated.len());
        for (i, new) in updated {
            match &new.copy {
                Some(copy) => self.params[i].set_value_with_copy(&new.param, Some(copy))?,
                None => news.push((i, new.param)),
            }
            self.m[i] = Some(new.m);
            self.v[i] = Some(new.v);
        }
        write_back_all(&self.params, news, self.zero)
    }
}

const SLOTS: &[&str] = &["exp_avg", "exp_avg_sq"];

/// How many of the updates `updated` of the views `views` are over their views' memory.
fn in_place_count(views: &[(usize, &Update)], updated: &[(usize, AdamWUpdated)]) -> usize {
    views
        .iter()
        .zip(updated)
        .filter(|((_, u), (_, new))| new.param.shares_piece(&u.value))
        .count()
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        let _ng = no_grad();
        let mut ups = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            if let Some(u) = update_view(p, self.zero)? {
                ups.push((i, u));
            }
        }
        self.update_all(ups, 1.0)?;
        self.steps += 1;
        Ok(())
    }
    fn apply(&mut self, scale: f64) -> Result<()> {
        let _ng = no_grad();
        self.pending = None;
        let ups = self.prepared.take("AdamW::apply")?;
        self.update_all(ups, scale)?;
        self.steps += 1;
        Ok(())
    }
    fn queue_apply(&mut self, ratio: Option<&Tensor>) -> Result<bool> {
        let _ng = no_grad();
        let views = self.prepared.views("AdamW::queue_apply")?;
        let clip = ratio.map_or(AdamWClip::Host, AdamWClip::Ratio);
        let updated = self.run_update(&views, 1.0, clip, false)?;
        self.in_place = 0;
        self.pending = Some(updated);
        Ok(true)
    }
    fn apply_queued_now(&mut self, ratio: Option<&Tensor>) -> Result<bool> {
        self.apply_now(ratio.map_or(AdamWClip::Host, AdamWClip::Ratio), false)
    }
    fn apply_guarded_now(&mut self, ratio: &Tensor) -> Result<bool> {
        self.apply_now(AdamWClip::Guarded(ratio), true)
    }
    fn commit(&mut self) -> Result<()> {
        let _ng = no_grad();
        let updated = self.pending.take().ok_or(TensorError::Kernel {
            op: "AdamW::commit",
            detail: "no update was queued".into(),
        })?;
        self.prepared.discard();
        self.write_updates(updated)?;
        self.steps += 1;
        Ok(())
    }
    fn discard(&mut self) {
        self.pending = None;
        self.prepared.discard();
    }
    fn state(&self, index: usize, slot: &str) -> Option<Tensor> {
        match slot {
            "exp_avg" => self.m.get(index).cloned().flatten(),
            "exp_avg_sq" => self.v.get(index).cloned().flatten(),
            _ => None,
        }
    }
    fn set_state(&mut self, index: usize, slot: &str, t: Tensor) -> Result<()> {
        let Some(p) = self.params.get(index) else {
            return Err(TensorError::Kernel {
                op: "AdamW::set_state",
                detail: format!("no parameter {index}"),
            });
        };
        let t = state_in_layout("AdamW::set_state", p, self.zero, slot, &t)?;
        match slot {
            "exp_avg" => self.m[index] = Some(t),
            "exp_avg_sq" => self.v[index] = Some(t),
            _ => {
                return Err(TensorError::Kernel {
                    op: "AdamW::set_state",
                    detail: format!("no state slot {slot}"),
                })
            }
        }
        Ok(())
    }
    optimizer_bookkeeping!();
}
