//! The autograd seam: per-tensor autograd metadata (requires_grad, grad slot, grad_fn node) and
//! the process-wide dispatch hook that a backward-recording engine installs.
//!
//! Contract for the autograd engine (issue 6): every op on tensors, local or global, goes through
//! `dispatch::dispatch(op, inputs)`, which after building the output calls the installed
//! [`DispatchHook`] with the op (global attributes), the inputs and the output. The hook records
//! a node (e.g. sets the output's `grad_fn` via [`Tensor::autograd`]) when any input requires a
//! gradient. Backward ops are ordinary ops (`Op::UnaryBackward`, `Op::SumToShape`, ...), so
//! gradients of global tensors get their SBP by the same inference.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::op::Op;
use crate::Tensor;

/// A node of the backward graph, created by the autograd engine.
pub trait GradFn: Send + Sync + fmt::Debug {
    /// The op the node differentiates (for printing).
    fn name(&self) -> &str;
    /// Downcasting hook for the engine.
    fn as_any(&self) -> &dyn Any;
}

/// Autograd state of one tensor. Interior mutability: tensors are shared through `Arc`.
#[derive(Default)]
pub struct AutogradMeta {
    requires_grad: AtomicBool,
    grad: Mutex<Option<Tensor>>,
    grad_fn: Mutex<Option<Arc<dyn GradFn>>>,
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
    pub fn grad_fn(&self) -> Option<Arc<dyn GradFn>> {
        self.grad_fn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    pub fn set_grad_fn(&self, f: Option<Arc<dyn GradFn>>) {
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

/// Called after every dispatched op (see the module docs).
pub trait DispatchHook: Send + Sync {
    fn after_op(&self, op: &Op, inputs: &[&Tensor], output: &Tensor);
}

static HOOK_SET: AtomicBool = AtomicBool::new(false);
static HOOK: RwLock<Option<Arc<dyn DispatchHook>>> = RwLock::new(None);

/// Installs (or with None removes) the process-wide dispatch hook.
pub fn set_dispatch_hook(hook: Option<Arc<dyn DispatchHook>>) {
    let set = hook.is_some();
    *HOOK.write().unwrap_or_else(|e| e.into_inner()) = hook;
    HOOK_SET.store(set, Ordering::Release);
}

/// Runs the hook when one is installed (one atomic load otherwise).
#[inline]
pub(crate) fn run_hook(op: &Op, inputs: &[&Tensor], output: &Tensor) {
    if !HOOK_SET.load(Ordering::Acquire) {
        return;
    }
    let hook = HOOK.read().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(h) = hook {
        h.after_op(op, inputs, output);
    }
}
