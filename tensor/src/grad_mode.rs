//! Grad mode: whether ops on this thread record the backward graph (on by default), switched
//! for a scope by [`no_grad`] and [`set_grad_enabled`]. A thread-local flag that every layer
//! may read (the autograd observer before recording, fused ops choosing a forward without
//! saved statistics).

use std::cell::Cell;

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
