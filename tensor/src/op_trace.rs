//! The tracer's observer of dispatch: each op call as a span on the trace's ops lane (its name
//! and input shapes), while the collectives' trace records. Installed where a rank's context
//! is made ([`install`]); the trace switches it on when it starts (at once if it runs already).

use std::borrow::Cow;
use std::cell::Cell;
use std::sync::Once;

use oxiflow_collectives::trace::{on_trace_enabled, trace_end, trace_start, Lane};

use crate::observe::{self, DispatchObserver, OpCall};
use crate::tensor::shapes_text;

thread_local! {
    /// When this thread's op call in flight began (None: the trace is off).
    static STARTED: Cell<Option<u64>> = const { Cell::new(None) };
}

struct OpTracer;

static TRACER: OpTracer = OpTracer;

impl DispatchObserver for OpTracer {
    fn starting(&self) {
        STARTED.set(trace_start());
    }

    fn op(&self, call: &OpCall<'_>) {
        trace_end(
            STARTED.take(),
            Lane::Ops,
            || Cow::Borrowed(call.op.name()),
            || vec![("inputs", shapes_text(call.inputs).into())],
        );
    }
}

/// Makes the trace switch the tracer on when it starts (once per process).
pub(crate) fn install() {
    on_trace_enabled(switch_on);
}

fn switch_on() {
    static ON: Once = Once::new();
    ON.call_once(|| observe::switch_on(&TRACER));
}
