//! Gradient-ready hooks: code that runs inside `backward` as each leaf's gradient becomes final
//! (its last incoming edge has been walked), e.g. data-parallel reduction in buckets launched
//! while the rest of the backward pass still runs. One hook per thread, installed for a scope.

use std::cell::RefCell;
use std::sync::Arc;

use crate::{Result, Tensor};

/// What the backward walk tells about the leaves' gradients.
pub trait GradReadyHook: Send + Sync {
    /// Whether the hook takes over `leaf`'s gradient: the walk then accumulates it into the
    /// leaf's grad slot as it comes (no boxing to the leaf's `grad_layout`) and calls `ready`.
    fn takes(&self, leaf: &Tensor) -> bool;
    /// `leaf`'s gradient of this pass is final and accumulated into `leaf.grad()`.
    fn ready(&self, leaf: &Tensor) -> Result<()>;
    /// The walk is over (every `ready` has been called).
    fn finish(&self) -> Result<()>;
}

thread_local! {
    static HOOK: RefCell<Option<Arc<dyn GradReadyHook>>> = const { RefCell::new(None) };
}

/// Restores the thread's previous hook when dropped (see [`install_grad_hook`]).
#[must_use = "the hook is removed when the guard drops"]
pub struct GradHookGuard {
    prev: Option<Arc<dyn GradReadyHook>>,
}

impl Drop for GradHookGuard {
    fn drop(&mut self) {
        let prev = self.prev.take();
        HOOK.with(|h| *h.borrow_mut() = prev);
    }
}

/// Makes every backward pass on this thread report to `hook` until the guard drops.
pub fn install_grad_hook(hook: Arc<dyn GradReadyHook>) -> GradHookGuard {
    let prev = HOOK.with(|h| h.borrow_mut().replace(hook));
    GradHookGuard { prev }
}

/// The hook installed on this thread.
pub(crate) fn current() -> Option<Arc<dyn GradReadyHook>> {
    HOOK.with(|h| h.borrow().clone())
}
