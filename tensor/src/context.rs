//! The per-rank runtime context: world communicator, rank, boxing planner and a cache slot the
//! layers above fill (dispatch keeps each global op call's signature, boxing plans and local
//! attributes there, keyed by the op: this layer knows no ops); installable per thread
//! (in-process ranks) with a process default.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, OnceLock, RwLock};

use oxiflow_boxing::BoxingPlanner;
use oxiflow_collectives::SharedComm;

use crate::{Result, TensorError};

pub(crate) struct ContextInner {
    world: SharedComm,
    rank: usize,
    world_size: usize,
    planner: BoxingPlanner,
    /// The cache of the layer above (dispatch's plans), made on first use.
    cache: OnceLock<Box<dyn Any + Send + Sync>>,
}

/// A rank's runtime context. Cheap to clone (shared). Global tensors keep the context they were
/// made in, so ops never look it up; creation ops and `to_global` take the current one.
#[derive(Clone)]
pub struct Context(pub(crate) Arc<ContextInner>);

thread_local! {
    static CURRENT: RefCell<Option<Context>> = const { RefCell::new(None) };
}
static DEFAULT: RwLock<Option<Context>> = RwLock::new(None);

/// Restores the thread's previous context when dropped (see `Context::install`).
pub struct ContextGuard {
    prev: Option<Context>,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let prev = self.prev.take();
        CURRENT.with(|c| *c.borrow_mut() = prev);
    }
}

impl Context {
    /// A context over a world communicator (member i of `world` is world rank
    /// `world.world_ranks()[i]`).
    pub fn new(world: SharedComm) -> Context {
        let rank = world
            .world_ranks()
            .get(world.rank())
            .copied()
            .unwrap_or(world.rank());
        let world_size = world.size();
        Context(Arc::new(ContextInner {
            world,
            rank,
            world_size,
            planner: BoxingPlanner::new(),
            cache: OnceLock::new(),
        }))
    }
    /// This process's (or thread's) world rank.
    pub fn rank(&self) -> usize {
        self.0.rank
    }
    pub fn world_size(&self) -> usize {
        self.0.world_size
    }
    pub fn world(&self) -> &SharedComm {
        &self.0.world
    }
    pub fn planner(&self) -> &BoxingPlanner {
        &self.0.planner
    }
    /// The context's cache of type `T`, made empty on first use; None when the slot holds
    /// another type (one layer, dispatch, keeps its cache here).
    pub(crate) fn cache<T: Any + Send + Sync + Default>(&self) -> Option<&T> {
        self.0
            .cache
            .get_or_init(|| Box::new(T::default()))
            .downcast_ref()
    }

    /// Makes this the current thread's context until the guard drops (for ranks run as threads).
    pub fn install(&self) -> ContextGuard {
        let prev = CURRENT.with(|c| c.borrow_mut().replace(self.clone()));
        ContextGuard { prev }
    }
    /// Makes this the process-wide default (used by threads without an installed context).
    pub fn set_default(&self) {
        *DEFAULT.write().unwrap_or_else(|e| e.into_inner()) = Some(self.clone());
    }
    /// The thread's installed context, else the process default.
    pub fn current() -> Option<Context> {
        CURRENT
            .with(|c| c.borrow().clone())
            .or_else(|| DEFAULT.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
    /// The current context or a typed error naming `op`.
    pub(crate) fn current_for(op: &'static str) -> Result<Context> {
        Context::current().ok_or(TensorError::NoContext { op })
    }
    /// Whether both handles are one context.
    pub fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Context(rank {} of {}, {})",
            self.0.rank,
            self.0.world_size,
            self.0.world.backend()
        )
    }
}
