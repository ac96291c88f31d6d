//! AdamW (decoupled weight decay), as torch.optim.AdamW:
//! p *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//! p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
//! `wd` is per parameter (`with_weight_decay`); a clipped step uses `c g` for `g`, folded
//! into the moments' coefficients.

use crate::nn::Parameter;
use crate::{Result, TensorError};
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

    /// The update of parameter `i` from its view, with the gradient scaled by `c`.
    fn update(&mut self, i: usize, u: Update, c: f64) -> Result<()> {
        let o = self.opts;
        let t = (self.steps + 1) as i32;
        let (bc1, bc2) = (1.0 - o.beta1.powi(t), 1.0 - o.beta2.powi(t));
        let Update { value: v0, grad: g } = u;
        // Fused passes: each moment in one, the new value in one; (c g)^2 = c^2 g^2.
        let (a1, a2) = ((1.0 - o.beta1) * c, (1.0 - o.beta2) * c * c);
        let m = match self.m[i].take() {
            Some(m) => m.adam_moment(&g, o.beta1, a1, false)?,
            None => g.mul_scalar(a1)?,
        };
        let v = match self.v[i].take() {
            Some(v) => v.adam_moment(&g, o.beta2, a2, true)?,
            None => g.square()?.mul_scalar(a2)?,
        };
        let decay = 1.0 - o.lr * self.decay[i];
        let new = v0.adam_update(&m, &v, [decay, o.lr / bc1, 1.0 / bc2, o.eps])?;
        write_back(&self.params[i], &new)?;
        self.m[i] = Some(m);
        self.v[i] = Some(v);
        Ok(())
    }
}

const SLOTS: &[&str] = &["exp_avg", "exp_avg_sq"];

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        let _ng = no_grad();
        for i in 0..self.params.len() {
            if let Some(u) = update_view(&self.params[i], self.zero)? {
                self.update(i, u, 1.0)?;
            }
        }
        self.steps += 1;
        Ok(())
    }
    fn prepare(&mut self) -> Result<f64> {
        self.prepared.prepare(&self.params, self.zero)
    }
    fn apply(&mut self, scale: f64) -> Result<()> {
        let _ng = no_grad();
        for (i, u) in self.prepared.take("AdamW::apply")? {
            self.update(i, u, scale)?;
        }
        self.steps += 1;
        Ok(())
    }
    fn discard(&mut self) {
        self.prepared.discard();
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
