//! Dispatch's observers: what watches op calls from above dispatch without dispatch knowing it.
//! Autograd records the backward graph, a compiled step's capture records the program, the
//! explain recorder the layouts and the tracer each op's span; each implements
//! [`DispatchObserver`] and switches itself on ([`switch_on`]) while it has something to do
//! (autograd from the first tensor that requires a gradient, a capture while a thread
//! captures, explain while recording, the tracer once the trace is on). Dispatch tells every
//! registered observer of every op call, boxing run and `to_global` while any is on; when none
//! is, each of those points costs one relaxed atomic load.
//!
//! Callbacks run inside dispatch: they must not dispatch ops.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use oxiflow_boxing::Plan;
use oxiflow_dtype::DType;
use oxiflow_sbp::{GlobalLayout, NdSbp};

use crate::context::Context;
use crate::op::{Op, OutSpec};
use crate::storage::{Device, Storage};
use crate::tensor::Tensor;

/// One op call as dispatch ran it on this rank.
pub(crate) struct OpCall<'a> {
    /// The op with its (global) attributes.
    pub op: &'a Op,
    /// The op with this rank's local attributes (what the kernel ran).
    pub local_op: &'a Op,
    pub inputs: &'a [&'a Tensor],
    /// The outputs, as the caller gets them.
    pub outputs: &'a [Tensor],
    /// The device of the inputs' pieces.
    pub device: Device,
    /// Each output's local shape and dtype; None outside the placement.
    pub out_specs: Option<&'a [OutSpec]>,
    /// The signature and boxing of a call on global tensors.
    pub global: Option<GlobalCall<'a>>,
}

/// What dispatch chose for a call on global tensors.
pub(crate) struct GlobalCall<'a> {
    /// Each input's boxing plan (None: the input already had the signature's layout).
    pub boxing: &'a [Option<Arc<Plan>>],
    /// Each input's piece made by its boxing (None: the input's own piece was read).
    pub boxed: &'a [Option<Arc<Storage>>],
    /// Each output's layout and dtype.
    pub outputs: &'a [(GlobalLayout, DType)],
    pub ctx: &'a Context,
}

impl OpCall<'_> {
    /// The pieces the kernel read, in input order (after boxing); empty outside the placement.
    pub fn kernel_inputs(&self) -> impl Iterator<Item = Arc<Storage>> + '_ {
        let boxed = self.global.as_ref().map_or(&[][..], |g| g.boxed);
        let inside = self.out_specs.is_some();
        self.inputs
            .iter()
            .enumerate()
            .filter(move |_| inside)
            .filter_map(move |(i, t)| {
                boxed
                    .get(i)
                    .and_then(Clone::clone)
                    .or_else(|| t.0.piece.clone())
            })
    }
}

/// One boxing run on this rank: `input` (None outside the source placement) became `output`
/// (None outside the target placement); the same piece when the plan left it unchanged.
#[derive(Clone, Copy)]
pub struct BoxingEvent<'a> {
    /// The op that asked for it (`to_global` for an explicit conversion).
    pub op: &'static str,
    pub plan: &'a Arc<Plan>,
    pub input: Option<&'a Arc<Storage>>,
    pub output: Option<&'a Arc<Storage>>,
    pub device: Device,
    pub ctx: &'a Context,
}

/// What watches dispatch (see the module docs).
pub(crate) trait DispatchObserver: Sync + Any {
    /// An op call begins (before any check).
    fn starting(&self) {}
    /// An op call ran and gave its outputs.
    fn op(&self, call: &OpCall<'_>);
    /// A boxing plan ran (inserted before an op, or asked for by `to_global`).
    fn boxing(&self, _call: &BoxingEvent<'_>) {}
    /// `to_global` made `output` of `input` (boxing, or a local tensor made global).
    fn to_global(&self, _input: &Tensor, _output: &Tensor, _nd_sbp: &NdSbp) {}
}

/// Most observers registered (the crate has four).
const SLOTS: usize = 8;

static OBSERVERS: [OnceLock<&'static dyn DispatchObserver>; SLOTS] =
    [const { OnceLock::new() }; SLOTS];
static REGISTERING: Mutex<()> = Mutex::new(());
/// Observers switched on (one count per reason: a capturing thread each).
static ON: AtomicUsize = AtomicUsize::new(0);

/// Whether any observer is on (one relaxed load).
#[inline]
pub(crate) fn any_on() -> bool {
    ON.load(Ordering::Relaxed) != 0
}

/// Registers `observer` (once) and counts one reason for observing.
pub(crate) fn switch_on(observer: &'static dyn DispatchObserver) {
    {
        let _g = REGISTERING.lock().unwrap_or_else(|e| e.into_inner());
        // Told apart by type: the observers are zero-sized statics, which may share an address.
        let fresh = OBSERVERS.iter().find(|slot| match slot.get() {
            Some(o) => (*o as &dyn Any).type_id() == (observer as &dyn Any).type_id(),
            None => true,
        });
        match fresh {
            Some(slot) => {
                let _ = slot.set(observer);
            }
            None => debug_assert!(false, "more than {SLOTS} dispatch observers"),
        }
    }
    ON.fetch_add(1, Ordering::Relaxed);
}

/// Ends one reason for observing counted by [`switch_on`].
pub(crate) fn switch_off() {
    let _ = ON.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
}

fn registered() -> impl Iterator<Item = &'static dyn DispatchObserver> {
    OBSERVERS.iter().map_while(|slot| slot.get().copied())
}

/// Tells every observer an op call begins (called when [`any_on`]).
#[cold]
pub(crate) fn starting() {
    registered().for_each(|o| o.starting());
}

/// Tells every observer of an op call (called when [`any_on`]).
#[cold]
pub(crate) fn op(call: &OpCall<'_>) {
    registered().for_each(|o| o.op(call));
}

/// Tells every observer of a boxing run, when any is on.
pub(crate) fn boxing(call: &BoxingEvent<'_>) {
    if any_on() {
        registered().for_each(|o| o.boxing(call));
    }
}

/// Tells every observer of a `to_global`, when any is on.
pub(crate) fn to_global(input: &Tensor, output: &Tensor, nd_sbp: &NdSbp) {
    if any_on() {
        registered().for_each(|o| o.to_global(input, output, nd_sbp));
    }
}
