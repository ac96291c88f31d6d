//! Optimizers: `Sgd` (momentum, weight decay) and `AdamW`. State tensors live in each
//! parameter's layout; the update first boxes the gradient to the parameter's layout, so a
//! partial-sum gradient of a broadcast weight is all-reduced there (data parallelism from the
//! algebra). Updates run under `no_grad` and replace each parameter's leaf.

mod adamw;
mod sgd;

pub use adamw::{AdamW, AdamWOptions};
pub use sgd::{Sgd, SgdOptions};

use crate::nn::Parameter;
use crate::Result;
use oxiflow_tensor::no_grad;
use oxiflow_tensor::Tensor;

/// What checkpoints and training loops need from an optimizer.
pub trait Optimizer {
    /// One update of every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;
    /// The parameters, in order.
    fn params(&self) -> &[Parameter];
    /// Names of the per-parameter state slots (e.g. `exp_avg`).
    fn slot_names(&self) -> &'static [&'static str];
    /// State slot `slot` of parameter `index` (None before the first step).
    fn state(&self, index: usize, slot: &str) -> Option<Tensor>;
    /// Sets a state slot (a checkpoint load); `t` must have the parameter's layout.
    fn set_state(&mut self, index: usize, slot: &str, t: Tensor) -> Result<()>;
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

/// The gradient of a parameter value boxed to its layout, or None when it has none.
pub(crate) fn grad_in_layout(value: &Tensor) -> Result<Option<Tensor>> {
    let _ng = no_grad();
    let Some(g) = value.grad() else {
        return Ok(None);
    };
    Ok(Some(match (value.placement(), value.nd_sbp()) {
        (Some(pl), Some(s)) => g.to_global(pl, s.clone())?,
        _ => g,
    }))
}

/// Checks that a state tensor has the parameter's shape, dtype and layout.
pub(crate) fn check_state(op: &'static str, p: &Parameter, slot: &str, t: &Tensor) -> Result<()> {
    let v = p.value();
    if t.shape() != v.shape() || t.dtype() != v.dtype() || t.layout() != v.layout() {
        return Err(oxiflow_tensor::TensorError::Shape {
            op,
            shapes: format!("{}, {}", v.shape(), t.shape()),
            sbps: format!("{:?}, {:?}", v.nd_sbp(), t.nd_sbp()),
            detail: format!(
                "state {slot} of {} must be {} but is {}",
                p.name(),
                v.describe(),
                t.describe()
            ),
        });
    }
    Ok(())
}
