//! AdamW (decoupled weight decay), as torch.optim.AdamW:
//! p *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//! p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
//! `wd` is per parameter (`with_weight_decay`); a clipped step uses `c g` for `g`, folded
//! into the moments' coefficients. A step updates every parameter with one multi-tensor op
//! (one device launch on CUDA) on each rank's pieces, whatever their layouts. A parameter
//! computed in another dtype (mixed precision) whose state lives in its leaf's own layout gets
//! its compute copy written by the same op, so its next forward pass casts nothing. An update
//! clipped by a device clip ratio can be queued before the host reads anything and committed
//! (or dropped) after (`queue_apply`, `commit`).

use crate::nn::Parameter;
use crate::{Result, TensorError};
use oxiflow_tensor::custom::{AdamWHyper, AdamWSlot, AdamWUpdated};
use oxiflow_tensor::no_grad;
use oxiflow_tensor::Tensor;

use super::{
    check_decay, state_in_layout, update_view, write_back, Optimizer, Prepared, Update, Zero,
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
        }
    }

    /// Shards state (and gradients, parameters) as `zero` says; see [`Zero::prepare`].
    pub fn with_zero(mut self, zero: Zero) -> Result<AdamW> {
        zero.prepare(&self.params)?;
        self.zero = zero;
        Ok(self)
    }

    /// Decays parameter `i` by `per_param[i]` (decay groups: e.g. 0 for biases, norms and
    /// embeddings); one finite value >= 0 per parameter.
    pub fn with_weight_decay(mut self, per_param: Vec<f64>) -> Result<AdamW> {
        check_decay("AdamW::with_weight_decay", &self.params, &per_param)?;
        self.decay = per_param;
        Ok(self)
    }

    /// One update of the parameters `ups` (index and update view) with gradients scaled by
    /// `c`, written back at once (see [`AdamW::run_update`]); each old compute copy's memory
    /// goes back before the op writes the new one.
    fn update_all(&mut self, ups: Vec<(usize, Update)>, c: f64) -> Result<()> {
        for (i, _) in &ups {
            self.params[*i].drop_copy();
        }
        let views: Vec<(usize, &Update)> = ups.iter().map(|(i, u)| (*i, u)).collect();
        let updated = self.run_update(&views, c, None)?;
        self.write_updates(updated)
    }

    /// The new values of the parameters `ups` (index and update view) with gradients scaled
    /// by `c` and, with `ratio`, clipped by its device value: one multi-tensor op over this
    /// rank's pieces of them all (see `Tensor::adamw_multi`), with each compute copy where the
    /// update runs in its leaf's layout (a ZeRO-1/2 shard is gathered in f32 and cast by the
    /// next forward pass, as before). Nothing is written back.
    fn run_update(
        &self,
        ups: &[(usize, &Update)],
        c: f64,
        ratio: Option<&Tensor>,
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
        let slots: Vec<AdamWSlot> = ups
            .iter()
            .map(|&(i, u)| {
                let p = &self.params[i];
                let (leaf, d) = (p.value(), p.compute_dtype());
                AdamWSlot {
                    param: &u.value,
                    grad: &u.grad,
                    m: self.m[i].as_ref(),
                    v: self.v[i].as_ref(),
                    weight_decay: self.decay[i],
                    compute_copy: (d != leaf.dtype() && u.value.layout() == leaf.layout())
                        .then_some(d),
                }
            })
            .collect();
        let updated = match ratio {
            Some(r) => Tensor::adamw_multi_clipped(&slots, &hyper, r)?,
            None => Tensor::adamw_multi(&slots, &hyper)?,
        };
        Ok(ups.iter().map(|(i, _)| *i).zip(updated).collect())
    }

    /// Each new value written back to its leaf's layout, with its compute copy, and the new
    /// moments kept.
    fn write_updates(&mut self, updated: Vec<(usize, AdamWUpdated)>) -> Result<()> {
        for (i, new) in updated {
            match &new.copy {
                Some(copy) => self.params[i].set_value_with_copy(&new.param, Some(copy))?,
                None => write_back(&self.params[i], &new.param)?,
            }
            self.m[i] = Some(new.m);
            self.v[i] = Some(new.v);
        }
        Ok(())
    }
}

const SLOTS: &[&str] = &["exp_avg", "exp_avg_sq"];

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
    fn prepare_queued(&mut self) -> Result<super::QueuedSum> {
        self.prepared.prepare(&self.params, self.zero)
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
        let updated = self.run_update(&views, 1.0, ratio)?;
        self.pending = Some(updated);
        Ok(true)
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
    fn prepared_gradients(&self) -> Vec<(usize, Tensor)> {
        self.prepared.gradients()
    }
    fn params(&self) -> &[Parameter] {
        &self.params
    }
    fn slot_names(&self) -> &'static [&'static str] {
        SLOTS
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
    fn zero(&self) -> Zero {
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
}
