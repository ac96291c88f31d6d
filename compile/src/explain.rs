//! What `train --compile --explain` prints about a compiled program (rank 0's): the captured
//! ops against the kernels kept, the element-wise groups fused (ops before -> after) and the
//! kernels generated for them, the arena against the eager peak, every collective in replay
//! order with the kernels queued between its launch and the first node that reads its result
//! (on devices the collective runs on the communicator's stream, so those kernels are what it
//! can overlap), and the largest buffers with their places.

use std::fmt::Write as _;

use crate::ir::{NodeKind, ValueId};
use crate::step::Compiled;

/// How many of the largest buffers the explanation lists.
const LARGEST: usize = 8;

/// The explanation of `c` (see the module docs).
pub fn explain(c: &Compiled) -> String {
    let (p, r) = (&c.program, &c.report);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "compiled program: {} ops captured, {} ops and {} boxings removed as dead, {} kernels and {} boxings kept",
        r.ops, r.removed.ops, r.removed.boxings, r.kernels, r.boxings
    );
    let f = &r.fusion;
    let _ = writeln!(
        out,
        "  fusion: {} element-wise ops -> {} kernels (one per fused group, writing {} values besides their roots, reading through {} relabelling boxings), {} generated kernels:",
        f.ops_fused,
        f.groups,
        f.escapes,
        f.relabels,
        f.kernels.len()
    );
    for (k, kernel) in f.kernels.iter().enumerate() {
        let _ = writeln!(
            out,
            "    kernel {k} on {}: {} ops -> 1, {} groups: {}",
            kernel.device,
            kernel.program.op_count(),
            kernel.groups,
            kernel.program
        );
    }
    let _ = writeln!(
        out,
        "  arena {} bytes for {} buffers (eager peak {}), inputs and constants {} bytes outside it",
        r.arena_bytes,
        c.arena.placed.len(),
        r.eager_peak
            .map_or_else(|| "unmeasured".to_string(), |b| format!("{b} bytes")),
        r.external_bytes
    );
    let reads = |v: ValueId| {
        let buffer = p.buffer_of(v);
        move |inputs: &[ValueId]| inputs.iter().any(|&i| p.buffer_of(i) == buffer)
    };
    let collectives: Vec<usize> = (0..p.nodes.len())
        .filter(|&i| p.nodes[i].communicates())
        .collect();
    let _ = writeln!(
        out,
        "  {} collectives in replay order (kernels queued before the first reader of the result):",
        collectives.len()
    );
    for &i in &collectives {
        let node = &p.nodes[i];
        let NodeKind::Boxing { op, plan } = &node.kind else {
            continue;
        };
        let first_reader = node.outputs.first().copied().flatten().and_then(|v| {
            let read = reads(v);
            (i + 1..p.nodes.len()).find(|&j| read(&p.nodes[j].inputs))
        });
        let (until, name) = match first_reader {
            Some(j) => (j, p.nodes[j].name()),
            None => (p.nodes.len(), "the step's end"),
        };
        let kernels = p.nodes[i + 1..until]
            .iter()
            .filter(|n| n.runs_kernel())
            .count();
        let _ = writeln!(
            out,
            "    node {i:>5} {op}: {} -> {}, {} bytes received per rank at most; {kernels} kernels before node {until} ({name})",
            plan.from.nd_sbp(),
            plan.to.nd_sbp(),
            plan.bytes_max()
        );
    }
    let mut largest: Vec<_> = c.arena.placed.iter().collect();
    largest.sort_by_key(|p| std::cmp::Reverse(p.life.bytes));
    let _ = writeln!(
        out,
        "  largest buffers (offset, bytes, written at node .. last read):"
    );
    for pl in largest.into_iter().take(LARGEST) {
        let v = &p.values[pl.life.buffer.index()];
        let _ = writeln!(
            out,
            "    {} {} {}: offset {}, {} bytes, nodes {}..{}",
            pl.life.buffer, v.dtype, v.shape, pl.offset, pl.life.bytes, pl.life.def, pl.life.last
        );
    }
    out
}
