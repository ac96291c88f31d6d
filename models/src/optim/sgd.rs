//! SGD with momentum and (coupled) weight decay, as torch.optim.SGD:
//! g += wd p; buf = momentum buf + (1 - dampening) g (buf = g at the first step); p -= lr buf.

use crate::nn::Parameter;
use crate::{Result, TensorError};
use oxiflow_tensor::no_grad;
use oxiflow_tensor::Tensor;

use super::{state_in_layout, update_view, write_back, Optimizer, Update, Zero};

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
    zero: Zero,
    bufs: Vec<Option<Tensor>>,
    steps: u64,
}

impl Sgd {
    pub fn new(params: Vec<Parameter>, opts: SgdOptions) -> Sgd {
        let bufs = vec![None; params.len()];
        Sgd {
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
}

const SLOTS: &[&str] = &["momentum_buffer"];

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _ng = no_grad();
        let o = self.opts;
        for (p, buf) in self.params.iter().zip(self.bufs.iter_mut()) {
            let Some(Update {
                value: v,
                grad: mut g,
            }) = update_view(p, self.zero)?
            else {
                continue;
            };
            if o.weight_decay != 0.0 {
                g = g.add(&v.mul_scalar(o.weight_decay)?)?;
            }
            let d = if o.momentum != 0.0 {
                let b = match buf.take() {
                    Some(b) => b
                        .mul_scalar(o.momentum)?
                        .add(&g.mul_scalar(1.0 - o.dampening)?)?,
                    None => g,
                };
                *buf = Some(b.clone());
                b
            } else {
                g
            };
            write_back(p, &v.sub(&d.mul_scalar(o.lr)?)?)?;
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
