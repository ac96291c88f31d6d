//! The explain recorder: while it is on, its dispatch observer records every global op's input
//! and output layouts (global shape, placement, nd-SBP) and every boxing dispatch runs (from
//! and to layout, bytes), so a program can print what one step of a model does to its tensors.
//! Process-wide; off by default. At most `MAX_EXPLAIN_EVENTS` events are kept; later ones are
//! counted as dropped.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use oxiflow_sbp::GlobalLayout;

use crate::observe::{self, BoxingEvent, DispatchObserver, OpCall};

/// Events one recording keeps at most.
pub const MAX_EXPLAIN_EVENTS: usize = 100_000;

/// One recorded event, in dispatch order.
#[derive(Clone, Debug, PartialEq)]
pub enum ExplainEvent {
    /// A global op and the layouts of its inputs and output (the activation).
    Op {
        op: &'static str,
        inputs: Vec<GlobalLayout>,
        output: GlobalLayout,
    },
    /// A boxing run for `op`: inserted before it for one input, or asked for explicitly
    /// (`to_global`-style conversions name themselves as the op).
    Boxing {
        op: &'static str,
        from: GlobalLayout,
        to: GlobalLayout,
        /// Steps of the plan, described.
        steps: Vec<String>,
        /// Most bytes any rank receives, and the sum over ranks (the plan's cost).
        bytes_max: u64,
        bytes_total: u64,
    },
}

/// What one recording saw.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExplainRecord {
    pub events: Vec<ExplainEvent>,
    pub dropped: usize,
}

#[derive(Default)]
struct Recording {
    events: Vec<ExplainEvent>,
    dropped: usize,
}

static ON: AtomicBool = AtomicBool::new(false);
static RECORDING: Mutex<Recording> = Mutex::new(Recording {
    events: Vec::new(),
    dropped: 0,
});

fn recording() -> MutexGuard<'static, Recording> {
    // Every critical section here is panic-free, so a poisoned lock holds valid events.
    RECORDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether the recorder is on.
#[inline]
pub fn explain_enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Turns the recorder on, dropping anything recorded before.
pub fn explain_start() {
    *recording() = Recording::default();
    if !ON.swap(true, Ordering::Relaxed) {
        observe::switch_on(&EXPLAIN);
    }
}

/// Turns the recorder off and returns what it recorded.
pub fn explain_finish() -> ExplainRecord {
    if ON.swap(false, Ordering::Relaxed) {
        observe::switch_off();
    }
    let r = std::mem::take(&mut *recording());
    ExplainRecord {
        events: r.events,
        dropped: r.dropped,
    }
}

#[cold]
fn push(event: ExplainEvent) {
    let mut r = recording();
    if r.events.len() >= MAX_EXPLAIN_EVENTS {
        r.dropped += 1;
    } else {
        r.events.push(event);
    }
}

/// The recorder's observer of dispatch.
struct ExplainObserver;

static EXPLAIN: ExplainObserver = ExplainObserver;

impl DispatchObserver for ExplainObserver {
    fn op(&self, call: &OpCall<'_>) {
        let (true, Some(g)) = (explain_enabled(), &call.global) else {
            return;
        };
        let Some((output, _)) = g.outputs.first() else {
            return;
        };
        push(ExplainEvent::Op {
            op: call.op.name(),
            inputs: call
                .inputs
                .iter()
                .filter_map(|t| t.layout().cloned())
                .collect(),
            output: output.clone(),
        });
    }

    fn boxing(&self, call: &BoxingEvent<'_>) {
        if !explain_enabled() {
            return;
        }
        let plan = call.plan;
        push(ExplainEvent::Boxing {
            op: call.op,
            from: plan.from.clone(),
            to: plan.to.clone(),
            steps: plan.steps.iter().map(|s| s.describe()).collect(),
            bytes_max: plan.bytes_max(),
            bytes_total: plan.steps.iter().map(|s| s.bytes_total).sum(),
        });
    }
}

impl ExplainRecord {
    /// Boxings recorded, in order.
    pub fn boxings(&self) -> impl Iterator<Item = &ExplainEvent> {
        self.events
            .iter()
            .filter(|e| matches!(e, ExplainEvent::Boxing { .. }))
    }

    /// One line per op (its output layout) and per boxing (with its bytes and steps), and a
    /// total of the boxing bytes.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let (mut n_box, mut max_sum, mut total_sum) = (0usize, 0u64, 0u64);
        for (i, e) in self.events.iter().enumerate() {
            match e {
                ExplainEvent::Op { op, inputs, output } => {
                    let _ = writeln!(s, "{i:>5} op {op:<16} -> {output}");
                    for input in inputs {
                        let _ = writeln!(s, "{:>5}    input {input}", "");
                    }
                }
                ExplainEvent::Boxing {
                    op,
                    from,
                    to,
                    steps,
                    bytes_max,
                    bytes_total,
                } => {
                    n_box += 1;
                    max_sum = max_sum.saturating_add(*bytes_max);
                    total_sum = total_sum.saturating_add(*bytes_total);
                    let _ = writeln!(
                        s,
                        "{i:>5} boxing for {op}: {} -> {} of {} on {}: {bytes_max} bytes max \
                         per rank, {bytes_total} bytes in all",
                        from.nd_sbp(),
                        to.nd_sbp(),
                        from.shape(),
                        to.placement()
                    );
                    for step in steps {
                        let _ = writeln!(s, "{:>5}    step {step}", "");
                    }
                }
            }
        }
        let _ = writeln!(
            s,
            "{n_box} boxing(s): {max_sum} bytes max per rank, {total_sum} bytes in all"
        );
        if self.dropped > 0 {
            let _ = writeln!(
                s,
                "({} event(s) beyond the first {MAX_EXPLAIN_EVENTS} dropped)",
                self.dropped
            );
        }
        s
    }
}
