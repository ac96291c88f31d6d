//! Reverse-mode autograd for local and global tensors.
//!
//! Autograd is an observer of dispatch (`observe`), switched on by the first tensor that
//! requires a gradient: from then on every op call's outputs get a [`Node`] (their `grad_fn`,
//! held by the tensor as a `GradFn`, with each output's index) when an input requires a
//! gradient and grad mode is on.
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
mod node;
mod recompute;

use std::sync::atomic::Ordering;
use std::sync::Once;

use oxiflow_sbp::NdSbp;

pub use crate::grad_mode::{is_grad_enabled, no_grad, set_grad_enabled, GradModeGuard};
pub use hook::{install_grad_hook, GradHookGuard, GradReadyHook};
pub use node::Node;
pub use recompute::recompute;

use crate::observe::{self, DispatchObserver, OpCall};
use crate::op::Op;
use crate::tensor::{AutogradMeta, Tensor};
use crate::Result;

/// Autograd's observer of dispatch: records each op call and `to_global`.
struct Recorder;

static RECORDER: Recorder = Recorder;

impl DispatchObserver for Recorder {
    fn op(&self, call: &OpCall<'_>) {
        node::record_op(call.op, call.inputs, call.outputs);
    }

    fn to_global(&self, input: &Tensor, output: &Tensor, nd_sbp: &NdSbp) {
        node::record_to_global(input, output, nd_sbp);
    }
}

/// Records `op` (global attributes) as the node of its `outputs` when an input requires a
/// gradient and grad mode is on: what the observer does for a dispatched op, for a result made
/// without running the op (a cast whose copy exists already).
pub(crate) fn record(op: &Op, inputs: &[&Tensor], outputs: &[Tensor]) {
    node::record_op(op, inputs, outputs)
}

impl AutogradMeta {
    /// Marks whether the tensor wants a gradient. The first tensor marked switches the
    /// recording observer of dispatch on (for the rest of the process).
    pub fn set_requires_grad(&self, v: bool) {
        if v {
            static RECORDING: Once = Once::new();
            RECORDING.call_once(|| observe::switch_on(&RECORDER));
        }
        self.requires_grad.store(v, Ordering::Relaxed)
    }
}

impl Tensor {
    /// Marks the tensor as a leaf that wants a gradient; returns it for chaining.
    pub fn requires_grad_(self, v: bool) -> Tensor {
        self.autograd().set_requires_grad(v);
        self
    }
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
}
