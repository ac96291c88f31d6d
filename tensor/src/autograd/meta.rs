//! `AutogradMeta`: per-tensor autograd state (requires_grad, the accumulated gradient, and the
//! node that made the tensor). Nodes are recorded by `autograd::record`, which `dispatch` calls
//! after every op; nothing outside this crate can install or replace that recording.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use oxiflow_sbp::NdSbp;

use super::node::Node;
use crate::Tensor;

/// Autograd state of one tensor. Interior mutability: tensors are shared through `Arc`.
#[derive(Default)]
pub struct AutogradMeta {
    requires_grad: AtomicBool,
    grad: Mutex<Option<Tensor>>,
    /// The node that made this tensor and which of its outputs this tensor is.
    grad_fn: Mutex<Option<(Arc<Node>, usize)>>,
    grad_layout: Mutex<Option<NdSbp>>,
}

impl AutogradMeta {
    pub fn requires_grad(&self) -> bool {
        self.requires_grad.load(Ordering::Relaxed)
    }
    pub fn set_requires_grad(&self, v: bool) {
        self.requires_grad.store(v, Ordering::Relaxed)
    }
    /// The accumulated gradient, if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.grad.lock().unwrap_or_else(|e| e.into_inner()) = g;
    }
    /// The node that made this tensor (None for leaves and tensors made without grad).
    pub fn grad_fn(&self) -> Option<Arc<Node>> {
        self.grad_edge().map(|(n, _)| n)
    }
    /// The node that made this tensor and the index of this tensor among its outputs.
    pub(crate) fn grad_edge(&self) -> Option<(Arc<Node>, usize)> {
        self.grad_fn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// The nd-SBP a leaf's gradient is boxed to as it accumulates (None: as it comes).
    pub fn grad_layout(&self) -> Option<NdSbp> {
        self.grad_layout
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    pub(crate) fn set_grad_layout(&self, nd: Option<NdSbp>) {
        *self.grad_layout.lock().unwrap_or_else(|e| e.into_inner()) = nd;
    }
    pub(crate) fn set_grad_fn(&self, f: Option<(Arc<Node>, usize)>) {
        *self.grad_fn.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }
}

impl fmt::Debug for AutogradMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AutogradMeta")
            .field("requires_grad", &self.requires_grad())
            .finish()
    }
}
