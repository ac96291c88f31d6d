//! Device lanes of the trace: with tracing on, work queued on a CUDA stream (an op's kernels on
//! the compute stream, a collective on an NCCL stream) is bracketed by two timing events. The
//! spans become wall-clock times against an *anchor*, an event recorded on an idle stream and
//! paired with the host clock, when the rank's trace is written or when many spans are
//! pending; each resolution takes a fresh anchor, so the f32 milliseconds of
//! `cuEventElapsedTime` never span long. Off, each bracket costs one relaxed atomic load.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use crate::trace::{self, Lane};

/// Spans kept before they are resolved (each holds two device events).
const MAX_PENDING: usize = 4096;

struct Span {
    lane: Lane,
    name: &'static str,
    start: CudaEvent,
    end: CudaEvent,
}

struct Anchor {
    event: CudaEvent,
    host_us: u64,
}

#[derive(Default)]
struct Timeline {
    anchor: Option<Anchor>,
    /// The stream the anchor was taken on (a new one is taken there after each resolution).
    stream: Option<Arc<CudaStream>>,
    pending: Vec<Span>,
}

static TIMELINE: Mutex<Timeline> = Mutex::new(Timeline {
    anchor: None,
    stream: None,
    pending: Vec::new(),
});

fn timeline() -> MutexGuard<'static, Timeline> {
    // Every critical section leaves the state valid, so a poisoned lock is still usable.
    TIMELINE.lock().unwrap_or_else(|e| e.into_inner())
}

fn timing_event(stream: &CudaStream) -> Option<CudaEvent> {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .ok()
}

/// An event that completes now on an idle `stream`, with the host time it completed at.
fn take_anchor(stream: &CudaStream) -> Option<Anchor> {
    stream.synchronize().ok()?;
    let event = timing_event(stream)?;
    event.synchronize().ok()?;
    Some(Anchor {
        event,
        host_us: trace::now_us(),
    })
}

/// The start of a span on `stream`, when tracing is on; None otherwise (and when an event
/// cannot be made: the trace then lacks that span and the work runs as usual).
pub fn begin(stream: &Arc<CudaStream>) -> Option<CudaEvent> {
    if !trace::trace_enabled() {
        return None;
    }
    {
        let mut t = timeline();
        if t.anchor.is_none() {
            t.anchor = Some(take_anchor(stream)?);
            t.stream = Some(stream.clone());
            trace::register_trace_flush(flush);
        }
    }
    timing_event(stream)
}

/// Ends the span begun by [`begin`] (which returned `start`) after the work queued since.
pub fn end(stream: &CudaStream, lane: Lane, name: &'static str, start: Option<CudaEvent>) {
    let Some(start) = start else {
        return;
    };
    let Some(end) = timing_event(stream) else {
        return;
    };
    let mut t = timeline();
    t.pending.push(Span {
        lane,
        name,
        start,
        end,
    });
    if t.pending.len() >= MAX_PENDING {
        resolve(&mut t);
    }
}

/// Records every pending span in the trace (waiting for their end events) and takes a new
/// anchor.
fn resolve(t: &mut Timeline) {
    let Some(anchor) = t.anchor.take() else {
        t.pending.clear();
        return;
    };
    for span in t.pending.drain(..) {
        let (Ok(from), Ok(to)) = (
            anchor.event.elapsed_ms(&span.start),
            anchor.event.elapsed_ms(&span.end),
        ) else {
            continue;
        };
        let us = |ms: f32| (f64::from(ms) * 1000.0).max(0.0) as u64;
        let start_us = anchor.host_us.saturating_add(us(from));
        let dur_us = us(to).saturating_sub(us(from));
        trace::record_span(
            start_us,
            dur_us,
            span.lane,
            Cow::Borrowed(span.name),
            Vec::new(),
        );
    }
    t.anchor = t.stream.as_deref().and_then(take_anchor).or(Some(anchor));
}

/// Resolves the pending spans; registered with the trace writer.
fn flush() {
    resolve(&mut timeline());
}
