//! Reverse-mode autograd for local and global tensors.
//!
//! Every op goes through `dispatch`, which calls [`record`]: the outputs get a [`Node`] (their
//! `grad_fn`, with each output's index) when an input requires a gradient and grad mode is on.
//! A node keeps edges to the nodes (or leaves) its inputs came from, the metadata of its inputs
//! and outputs, and only the tensors its op's backward declared (`OpFamily::saves`); it
//! releases them when its backward runs. `backward()` walks the
//! nodes once each in reverse topological order and runs each node's backward rule (defined
//! with its op in `op/`), built from ordinary ops (`sum_to_shape`, `unary_backward`, ...), so
//! the gradients of global tensors get their nd-SBP by the same signature inference as the
//! forward: the gradient of a B weight used with S(0) data comes out P. `to_global` (boxing) is
//! the identity on values; its backward boxes the gradient back to the input's layout.
//!
//! ```text
//! let w = Tensor::randn([3, 2], 1, F64).requires_grad_(true);
//! let loss = x.matmul(&w)?.square()?.sum_all()?;
//! loss.backward()?;                 // accumulates into w.grad()
//! let _g = no_grad();               // e.g. around an optimizer update
//! ```

mod engine;
mod hook;
mod meta;
mod node;
mod recompute;

use std::cell::Cell;
use std::sync::Arc;

use oxiflow_sbp::NdSbp;

pub use hook::{install_grad_hook, GradHookGuard, GradReadyHook};
pub use meta::AutogradMeta;
pub use node::Node;
pub use recompute::recompute;

use crate::op::Op;
use crate::tensor::{Tensor, TensorImpl};
use crate::Result;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record the backward graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the thread's previous grad mode when dropped (see [`no_grad`]).
#[must_use = "grad mode is restored when the guard drops"]
pub struct GradModeGuard {
    prev: bool,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        let prev = self.prev;
        GRAD_ENABLED.with(|g| g.set(prev));
    }
}

/// Turns graph recording off on this thread until the guard drops.
pub fn no_grad() -> GradModeGuard {
    set_grad_enabled(false)
}

/// Sets this thread's grad mode until the guard drops.
pub fn set_grad_enabled(on: bool) -> GradModeGuard {
    let prev = GRAD_ENABLED.with(|g| g.replace(on));
    GradModeGuard { prev }
}

/// Records a dispatched op (global attributes) as the node of its `outputs` when an input
/// requires a gradient and grad mode is on. Called by `dispatch` after every op.
pub(crate) fn record(op: Op, inputs: &[&Tensor], outputs: &[Tensor]) {
    node::record_op(op, inputs, outputs)
}

/// Records a `to_global` (boxing or local -> global) of `input` into `output`, when `input`
/// requires a gradient. Called by `Tensor::to_global`.
pub(crate) fn record_to_global(input: &Tensor, output: &Tensor, nd_sbp: &NdSbp) {
    node::record_to_global(input, output, nd_sbp)
}

impl Tensor {
    /// Backpropagates from this tensor (seed gradient: ones of its shape) and accumulates
    /// gradients into the leaves' grad slots. Every rank of a global tensor must call it. Each
    /// node releases the tensors it saved as its backward runs, so a second backward through
    /// the same nodes is a typed error (see [`Tensor::backward_retaining`]).
    pub fn backward(&self) -> Result<()> {
        engine::backward(self, None, false)
    }
    /// Backpropagates with an explicit seed gradient of this tensor's shape.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        engine::backward(self, Some(grad.clone()), false)
    }
    /// `backward` that keeps every node's saved tensors, so the graph can be backpropagated
    /// through again.
    pub fn backward_retaining(&self) -> Result<()> {
        engine::backward(self, None, true)
    }
    /// The accumulated gradient of a leaf.
    pub fn grad(&self) -> Option<Tensor> {
        self.autograd().grad()
    }
    /// Boxes this leaf's gradient to `nd_sbp` (on its own placement) as each backward pass
    /// accumulates it, e.g. a data-parallel partial sum reduce-scattered straight into a shard
    /// (ZeRO-2). Checked against the tensor's shape and placement before any backward runs.
    pub fn set_grad_layout(&self, nd_sbp: NdSbp) -> Result<()> {
        let Some(layout) = self.layout() else {
            return Err(crate::TensorError::Autograd {
                op: "set_grad_layout",
                detail: format!("{} is not global", self.describe()),
            });
        };
        layout
            .with_nd_sbp(nd_sbp.clone())
            .map_err(|e| crate::TensorError::Autograd {
                op: "set_grad_layout",
                detail: format!("{} cannot take {nd_sbp}: {e}", self.describe()),
            })?;
        self.autograd().set_grad_layout(Some(nd_sbp));
        Ok(())
    }
    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        self.autograd().set_grad(None)
    }
    /// A tensor sharing this one's data without autograd history (and not requiring grad).
    pub fn detach(&self) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            piece: self.0.piece.clone(),
            local_shape: self.0.local_shape.clone(),
            dtype: self.0.dtype,
            device: self.0.device,
            global: self.0.global.clone(),
            autograd: Default::default(),
        }))
    }
    /// Whether the tensor has no autograd history (a leaf, when it requires grad).
    pub fn is_leaf(&self) -> bool {
        self.autograd().grad_fn().is_none()
    }
    /// The name of the op that made this tensor, when it has autograd history.
    pub fn grad_fn_name(&self) -> Option<String> {
        self.autograd().grad_fn().map(|f| f.name().to_string())
    }
}
