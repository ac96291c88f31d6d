//! The capture seam: while a thread has a [`CaptureSink`] installed ([`start_capture`]), the
//! capture's observer of dispatch (`observe`) tells it of every op dispatch runs (the op with
//! its attributes, the global signature chosen for it, this rank's local op, the pieces the
//! kernel read and wrote) and every boxing plan dispatch runs (inserted before an op or asked
//! for by `to_global`), and the seam tells it of every host read of a tensor's value, so a
//! compiler can record the step as a program and replay it later through [`run_local_kernel`]
//! and [`run_boxing`] without dispatch. Values are named by their piece (`Arc<Storage>`):
//! tensors that share a piece share a value. When no thread captures, each point costs one
//! relaxed atomic load.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use oxiflow_dtype::DType;
use oxiflow_sbp::{GlobalLayout, NdSbp};
use smallvec::SmallVec;

use crate::context::Context;
use crate::executor::run_kernel;
use crate::observe::{self, DispatchObserver, OpCall};
use crate::op::{Op, OutSpec, ViewOf};
use crate::storage::{Device, Storage};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

/// The global signature of a captured op on global tensors.
#[derive(Clone, Debug)]
pub struct GlobalSignature<'a> {
    /// Each input's layout as given (before boxing).
    pub inputs: &'a [&'a GlobalLayout],
    /// Each input's nd-SBP in the chosen signature (what boxing made of it).
    pub input_sbps: Vec<NdSbp>,
    /// Each output's layout and dtype.
    pub outputs: Vec<(GlobalLayout, DType)>,
    /// The rank's runtime context (its world, for replaying the boxing).
    pub ctx: &'a Context,
}

/// One op as dispatch ran it on this rank.
pub struct OpEvent<'a> {
    /// The op with its (global) attributes.
    pub op: &'a Op,
    /// The op with this rank's local attributes (what the kernel ran).
    pub local_op: &'a Op,
    /// The signature, for an op on global tensors.
    pub global: Option<GlobalSignature<'a>>,
    /// The device the kernel ran on.
    pub device: Device,
    /// The pieces the kernel read, in input order (after boxing); empty outside the placement.
    pub kernel_inputs: SmallVec<[Arc<Storage>; 3]>,
    /// Each output's local shape and dtype; None outside the placement.
    pub out_specs: Option<&'a [OutSpec]>,
    /// Output 0 is a run of an input's elements under a new shape (a reshape, an elements
    /// range: a view on devices that share memory).
    pub view_of: Option<ViewOf>,
    /// The outputs, as the caller gets them.
    pub outputs: &'a [Tensor],
}

/// What a capture is told. Callbacks run inside dispatch: they must not run ops.
pub trait CaptureSink {
    fn op(&mut self, event: OpEvent<'_>);
    fn boxing(&mut self, event: BoxingEvent<'_>);
    /// A host read of a tensor's value (`what`: `to_ndarray`, `to_vec`, ...): a program whose
    /// result depends on it cannot be replayed.
    fn host_read(&mut self, what: &'static str, tensor: &Tensor);
    /// A tensor made from host data (`from_vec`, `from_array`, `scalar`) inside the step: a
    /// replay would see the data of the capture, so it must come in as a step input.
    fn host_data(&mut self, what: &'static str, tensor: &Tensor);
    /// Whether the values the capture computes on a device are replaced before anything reads
    /// them (the capture's caller replays the recorded program for them): then a kernel may
    /// compute them by other kernels of the same op while the ones replays run are made ready
    /// ([`device_values_replaced`]). Default: no.
    fn replaces_device_values(&self) -> bool {
        false
    }
}

/// Threads with a sink installed.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SINK: RefCell<Option<Box<dyn CaptureSink>>> = const { RefCell::new(None) };
}

/// Whether some thread captures (one relaxed load); the thread's own sink is checked after.
#[inline]
pub(crate) fn any_capturing() -> bool {
    ACTIVE.load(Ordering::Relaxed) != 0
}

/// Whether this thread captures.
pub fn capturing() -> bool {
    any_capturing() && SINK.with(|s| s.try_borrow().map(|s| s.is_some()).unwrap_or(true))
}

/// Whether this thread captures into a sink that replaces the values computed on a device
/// (see [`CaptureSink::replaces_device_values`]).
pub fn device_values_replaced() -> bool {
    any_capturing()
        && SINK.with(|s| {
            s.try_borrow()
                .ok()
                .and_then(|s| s.as_ref().map(|k| k.replaces_device_values()))
                .unwrap_or(false)
        })
}

/// Installs `sink` on this thread until the guard is dropped or [`finish_capture`] runs; an
/// error when the thread already captures.
pub fn start_capture(sink: Box<dyn CaptureSink>) -> Result<CaptureGuard> {
    SINK.with(|s| {
        let mut s = s.try_borrow_mut().map_err(|_| busy())?;
        if s.is_some() {
            return Err(busy());
        }
        *s = Some(sink);
        ACTIVE.fetch_add(1, Ordering::Relaxed);
        observe::switch_on(&CAPTURE);
        Ok(CaptureGuard { _private: () })
    })
}

fn busy() -> TensorError {
    TensorError::Capture {
        op: "start_capture",
        detail: "this thread is already capturing a step".into(),
    }
}

/// Ends this thread's capture (dropping its sink).
pub struct CaptureGuard {
    _private: (),
}

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        let had = SINK.with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.take()));
        if had.is_some() {
            ACTIVE.fetch_sub(1, Ordering::Relaxed);
            observe::switch_off();
        }
    }
}

/// Runs `f` with this thread's sink, if it has one (not re-entered from a callback).
#[cold]
fn with_sink(f: impl FnOnce(&mut dyn CaptureSink)) {
    SINK.with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            if let Some(sink) = s.as_mut() {
                f(sink.as_mut());
            }
        }
    });
}

/// The capture's observer of dispatch: hands each op call and boxing run to the thread's sink.
struct CaptureObserver;

static CAPTURE: CaptureObserver = CaptureObserver;

impl DispatchObserver for CaptureObserver {
    fn op(&self, call: &OpCall<'_>) {
        if !any_capturing() {
            return;
        }
        let layouts: SmallVec<[&GlobalLayout; 3]> =
            call.inputs.iter().filter_map(|t| t.layout()).collect();
        let global = call.global.as_ref().map(|g| GlobalSignature {
            inputs: &layouts,
            input_sbps: layouts
                .iter()
                .zip(g.boxing)
                .map(|(l, b)| match b {
                    Some(plan) => plan.to.nd_sbp().clone(),
                    None => l.nd_sbp().clone(),
                })
                .collect(),
            outputs: g.outputs.to_vec(),
            ctx: g.ctx,
        });
        with_sink(|s| {
            s.op(OpEvent {
                op: call.op,
                local_op: call.local_op,
                global,
                device: call.device,
                kernel_inputs: call.kernel_inputs().collect(),
                out_specs: call.out_specs,
                view_of: call.local_op.view_of(),
                outputs: call.outputs,
            })
        });
    }

    fn boxing(&self, call: &BoxingEvent<'_>) {
        if !any_capturing() {
            return;
        }
        with_sink(|s| s.boxing(*call));
    }
}

/// Tells the thread's sink of a host read of `t` and refuses it: a captured step must not read
/// device values on the host (its result would not be replayable). Every rank runs the same
/// step, so every rank refuses alike, before any communication.
pub(crate) fn refuse_host_read(what: &'static str, t: &Tensor) -> Result<()> {
    if !any_capturing() || !capturing() {
        return Ok(());
    }
    with_sink(|s| s.host_read(what, t));
    Err(TensorError::Capture {
        op: what,
        detail: format!(
            "a compiled step reads the value of {} on the host; pass host values in as step \
             inputs or read them after the step",
            t.describe()
        ),
    })
}

/// Tells the thread's sink of a tensor made from host data.
pub(crate) fn note_host_data(what: &'static str, t: &Tensor) {
    if any_capturing() {
        with_sink(|s| s.host_data(what, t));
    }
}

/// Runs `op` (local attributes) on this rank's `pieces` through the device's executor, as
/// dispatch does: one piece per output of `outs`, allocated by the backend.
pub fn run_local_kernel(
    op: &Op,
    pieces: &[&Storage],
    device: Device,
    outs: &[OutSpec],
) -> Result<SmallVec<[Storage; 1]>> {
    run_kernel(op, pieces, device, outs)
}

/// Runs a boxing plan on this rank's piece as dispatch does.
pub use crate::dispatch::run_boxing;
pub use crate::observe::BoxingEvent;

/// A tensor over `piece`: global with `layout` in `ctx` when given, else local (which needs a
/// piece). The piece must have the shape the layout gives this rank and `dtype`.
pub fn tensor_from_piece(
    piece: Option<Arc<Storage>>,
    layout: Option<(&GlobalLayout, &Context)>,
    dtype: DType,
) -> Result<Tensor> {
    let bad = |detail: String| TensorError::Capture {
        op: "tensor_from_piece",
        detail,
    };
    if let Some(p) = &piece {
        if p.dtype() != dtype {
            return Err(bad(format!("piece of {} is not {dtype}", p.dtype())));
        }
    }
    match (layout, piece) {
        (Some((l, ctx)), piece) => {
            let want = l.local_shape(ctx.rank());
            if want != piece.as_ref().map(|p| p.shape()) {
                return Err(bad(format!(
                    "rank {} of {l} needs a piece of {want:?}, got {:?}",
                    ctx.rank(),
                    piece.as_ref().map(|p| p.shape())
                )));
            }
            Ok(Tensor::global_from_shared(
                piece,
                l.clone(),
                dtype,
                ctx.clone(),
            ))
        }
        (None, Some(p)) => Ok(Tensor::from_shared(p)),
        (None, None) => Err(bad("a local tensor needs a piece".into())),
    }
}

/// A tensor's piece, shared (None outside its placement).
pub fn piece_of(t: &Tensor) -> Option<&Arc<Storage>> {
    t.0.piece.as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that records nothing and says whether it replaces device values.
    struct Quiet(bool);

    impl CaptureSink for Quiet {
        fn op(&mut self, _: OpEvent<'_>) {}
        fn boxing(&mut self, _: BoxingEvent<'_>) {}
        fn host_read(&mut self, _: &'static str, _: &Tensor) {}
        fn host_data(&mut self, _: &'static str, _: &Tensor) {}
        fn replaces_device_values(&self) -> bool {
            self.0
        }
    }

    /// A sink that does not replace device values by default.
    struct Plain;

    impl CaptureSink for Plain {
        fn op(&mut self, _: OpEvent<'_>) {}
        fn boxing(&mut self, _: BoxingEvent<'_>) {}
        fn host_read(&mut self, _: &'static str, _: &Tensor) {}
        fn host_data(&mut self, _: &'static str, _: &Tensor) {}
    }

    #[test]
    fn provisional_device_values_only_under_a_sink_that_replaces_them() {
        assert!(!device_values_replaced(), "no capture");
        {
            let _g = start_capture(Box::new(Plain)).unwrap();
            assert!(capturing());
            assert!(
                !device_values_replaced(),
                "the default keeps the capture's values"
            );
        }
        {
            let _g = start_capture(Box::new(Quiet(true))).unwrap();
            assert!(device_values_replaced());
            // Another thread does not capture.
            assert!(!std::thread::spawn(device_values_replaced).join().unwrap());
        }
        {
            let _g = start_capture(Box::new(Quiet(false))).unwrap();
            assert!(!device_values_replaced());
        }
        assert!(!device_values_replaced(), "the guard ended the capture");
    }
}
