//! SGD with momentum and (coupled) weight decay, as torch.optim.SGD:
//! g += wd p; buf = momentum buf + (1 - dampening) g (buf = g at the first step); p -= lr buf.
//! `wd` is per parameter (`with_weight_decay`); a clipped step scales `g` before the decay.

use crate::nn::Parameter;
use crate::{Result, TensorError};
use oxiflow_tensor::no_grad;
use oxiflow_tensor::Tensor;

use super::{
    check_decay, state_in_layout, update_view, write_back_all, Optimizer, Prepared, Update, Zero,
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdOptions {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
}

impl Default for SgdOptions {
    fn default() -> Self {
        SgdOptions {
            lr: 0.01,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
        }
    }
}

/// Stochastic gradient descent with momentum; the momentum buffer lives in the parameter's
/// layout, or its shard under ZeRO.
pub struct Sgd {
    params: Vec<Parameter>,
    opts: SgdOptions,
    /// Weight decay of each parameter (`opts.weight_decay` unless set per parameter).
    decay: Vec<f64>,
    /// Gradients boxed by `prepare`, for the next `apply`.
    prepared: Prepared,
    zero: Zero,
    bufs: Vec<Option<Tensor>>,
    steps: u64,
}

impl Sgd {
    pub fn new(params: Vec<Parameter>, opts: SgdOptions) -> Sgd {
        let bufs = vec![None; params.len()];
        Sgd {
            decay: vec![opts.weight_decay; params.len()],
            prepared: Prepared::default(),
            params,
            opts,
            zero: Zero::OFF,
            bufs,
            steps: 0,
        }
    }

    /// Shards state (and gradients, parameters) as `zero` says; see [`Zero::prepare`].
    pub fn with_zero(mut self, zero: Zero) -> Result<Sgd> {
        zero.prepare(&self.params)?;
        self.zero = zero;
        Ok(self)
    }

    /// Decays parameter `i` by `per_param[i]`; one finite value >= 0 per parameter.
    pub fn with_weight_decay(mut self, per_param: Vec<f64>) -> Result<Sgd> {
        check_decay("Sgd::with_weight_decay", &self.params, &per_param)?;
        self.decay = per_param;
        Ok(self)
    }

    /// The new value of parameter `i` (in its view's layout) from its view, with the gradient
    /// scaled by `c`; the momentum buffer is updated.
    fn update(&mut self, i: usize, u: Update, c: f64) -> Result<Tensor> {
        let o = self.opts;
        let Update { value: v, grad: g } = u;
        let mut g = if c == 1.0 { g } else { g.mul_scalar(c)? };
        if self.decay[i] != 0.0 {
            g = g.add(&v.mul_scalar(self.decay[i])?)?;
        }
        let d = if o.momentum != 0.0 {
            let b = match self.bufs[i].take() {
                Some(b) => b
                    .mul_scalar(o.momentum)?
                    .add(&g.mul_scalar(1.0 - o.dampening)?)?,
                None => g,
            };
            self.bufs[i] = Some(b.clone());
            b
        } else {
            g
        };
        v.sub(&d.mul_scalar(o.lr)?)
    }
}

const SLOTS: &[&str] = &["momentum_buffer"];

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _ng = no_grad();
        let mut news = Vec::new();
        for i in 0..self.params.len() {
            if let Some(u) = update_view(&self.params[i], self.zero)? {
                news.push((i, self.update(i, u, 1.0)?));
            }
        }
        write_back_all(&self.params, news, self.zero)?;
        self.steps += 1;
        Ok(())
    }
    fn apply(&mut self, scale: f64) -> Result<()> {
        let _ng = no_grad();
        let mut news = Vec::new();
        for (i, u) in self.prepared.take("Sgd::apply")? {
            news.push((i, self.update(i, u, scale)?));
        }
        write_back_all(&self.params, news, self.zero)?;
        self.steps += 1;
        Ok(())
    }
    fn discard(&mut self) {
        self.prepared.discard();
    }
    fn state(&self, index: usize, slot: &str) -> Option<Tensor> {
        (slot == SLOTS[0])
            .then(|| self.bufs.get(index).cloned().flatten())
            .flatten()
    }
    fn set_state(&mut self, index: usize, slot: &str, t: Tensor) -> Result<()> {
        let (Some(p), true) = (self.params.get(index), slot == SLOTS[0]) else {
            return Err(TensorError::Kernel {
                op: "Sgd::set_state",
                detail: format!("no state slot {slot} for parameter {index}"),
            });
        };
        let t = state_in_layout("Sgd::set_state", p, self.zero, slot, &t)?;
        self.bufs[index] = Some(t);
        Ok(())
    }
    optimizer_bookkeeping!();
}
