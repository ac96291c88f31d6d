//! Liveness with the execution order fixed (the captured order): for every buffer a node
//! writes, the first node that writes it and the last that reads it (through any alias: a
//! view or a boxing that left its piece as it was); buffers the step returns live to the end.
//! Also, per node, the values whose last read it is, which a replay drops after the node.
//! A collective's result is no buffer of the arena's: the collective writes a piece of its own,
//! and copying it into a place would make the compute stream wait for the collective there,
//! while its first reader waits only when it runs (a data-parallel bucket's reduction overlaps
//! the rest of the backward pass).

use crate::ir::{Origin, Program, ValueId};
use crate::passes::dce::is_defined;

/// The lifetime of one buffer a node writes: written by node `def`, last read by node `last`
/// (`nodes.len()` when the step returns it), inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferLife {
    /// The value that owns the buffer (not an alias).
    pub buffer: ValueId,
    pub bytes: usize,
    pub def: usize,
    pub last: usize,
}

impl BufferLife {
    /// Whether two lifetimes share a node (then the buffers must not share bytes).
    pub fn overlaps(&self, other: &BufferLife) -> bool {
        self.def <= other.last && other.def <= self.last
    }
}

/// Liveness of a program.
#[derive(Clone, Debug, Default)]
pub struct Liveness {
    /// Buffers written by the program's nodes, in order of their first write.
    pub buffers: Vec<BufferLife>,
    /// For each node, the values read or written for the last time there.
    pub release_after: Vec<Vec<ValueId>>,
    /// Most bytes of written buffers live at once (a lower bound of any arena).
    pub peak_live_bytes: usize,
}

/// Computes the liveness of `program`'s nodes in their order.
pub fn liveness(program: &Program) -> Liveness {
    let n = program.nodes.len();
    let end = n;
    // Last use of every value (reads; outputs of the step at `end`).
    let mut last_use: Vec<Option<usize>> = vec![None; program.values.len()];
    let mut def: Vec<Option<usize>> = vec![None; program.values.len()];
    for (i, node) in program.nodes.iter().enumerate() {
        for v in &node.inputs {
            last_use[v.index()] = Some(i);
        }
        for v in node.outputs.iter().flatten() {
            def[v.index()] = Some(i);
        }
    }
    for v in program.output_values() {
        last_use[v.index()] = Some(end);
    }
    // Per buffer (root of the alias chain): the last use of any value in it.
    let mut buffer_last: Vec<Option<usize>> = vec![None; program.values.len()];
    for (i, v) in program.values.iter().enumerate() {
        let id = ValueId(i as u32);
        if !is_defined(program, id) {
            continue;
        }
        let root = program.buffer_of(id);
        let last = last_use[i].or(def[i]);
        let slot = &mut buffer_last[root.index()];
        *slot = (*slot).max(last);
        let _ = v;
    }
    let mut buffers = Vec::new();
    for (i, v) in program.values.iter().enumerate() {
        let id = ValueId(i as u32);
        if v.alias_of.is_some() || !matches!(v.origin, Origin::Node { .. }) {
            continue;
        }
        if def[i].is_some_and(|d| program.nodes[d].communicates()) {
            continue;
        }
        if !is_defined(program, id) {
            continue;
        }
        let (Some(d), Some(l)) = (def[i], buffer_last[i]) else {
            continue;
        };
        buffers.push(BufferLife {
            buffer: id,
            bytes: v.bytes(),
            def: d,
            last: l,
        });
    }
    buffers.sort_by_key(|b| (b.def, b.buffer));
    let mut release_after = vec![Vec::new(); n];
    for (i, _) in program.values.iter().enumerate() {
        let id = ValueId(i as u32);
        if !is_defined(program, id) {
            continue;
        }
        match last_use[i].or(def[i]) {
            Some(at) if at < end => release_after[at].push(id),
            _ => {}
        }
    }
    let peak_live_bytes = peak_of(&buffers, n + 1);
    Liveness {
        buffers,
        release_after,
        peak_live_bytes,
    }
}

/// Most bytes of `buffers` live at one node of `steps`.
fn peak_of(buffers: &[BufferLife], steps: usize) -> usize {
    let mut delta = vec![0i128; steps + 1];
    for b in buffers {
        delta[b.def] += b.bytes as i128;
        delta[(b.last + 1).min(steps)] -= b.bytes as i128;
    }
    let (mut live, mut peak) = (0i128, 0i128);
    for d in delta {
        live += d;
        peak = peak.max(live);
    }
    peak.max(0) as usize
}
