//! AdamW (decoupled weight decay), as torch.optim.AdamW:
//! p *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//! p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).

use crate::nn::Parameter;
use crate::{Result, TensorError};
use oxiflow_tensor::no_grad;
use oxiflow_tensor::Tensor;

use super::{state_in_layout, update_view, write_back, Optimizer, Update, Zero};

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
    zero: Zero,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    steps: u64,
}

impl AdamW {
    pub fn new(params: Vec<Parameter>, opts: AdamWOptions) -> AdamW {
        let n = params.len();
        AdamW {
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
}

const SLOTS: &[&str] = &["exp_avg", "exp_avg_sq"];

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        let _ng = no_grad();
        let o = self.opts;
        let t = (self.steps + 1) as i32;
        let (bc1, bc2) = (1.0 - o.beta1.powi(t), 1.0 - o.beta2.powi(t));
        for (i, p) in self.params.iter().enumerate() {
            let Some(Update { value: v0, grad: g }) = update_view(p, self.zero)? else {
                continue;
            };
            // Fused passes: each moment in one, the new value in one.
            let m = match self.m[i].take() {
                Some(m) => m.adam_moment(&g, o.beta1, 1.0 - o.beta1, false)?,
                None => g.mul_scalar(1.0 - o.beta1)?,
            };
            let v = match self.v[i].take() {
                Some(v) => v.adam_moment(&g, o.beta2, 1.0 - o.beta2, true)?,
                None => g.square()?.mul_scalar(1.0 - o.beta2)?,
            };
            let decay = 1.0 - o.lr * o.weight_decay;
            let new = v0.adam_update(&m, &v, [decay, o.lr / bc1, 1.0 / bc2, o.eps])?;
            write_back(p, &new)?;
            self.m[i] = Some(m);
            self.v[i] = Some(v);
        }
        self.steps += 1;
        Ok(())
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
