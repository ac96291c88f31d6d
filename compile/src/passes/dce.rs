//! Dead-code elimination: removes the nodes no step output depends on. A node that
//! communicates is kept whatever this rank needs of it (every member of its collectives must
//! run it, in the same order), so the passes never make ranks disagree on the collectives.

use crate::ir::{NodeKind, Origin, Program, ValueId};

/// What DCE removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DceStats {
    /// Op nodes removed.
    pub ops: usize,
    /// Boxing nodes removed (only ones without communication).
    pub boxings: usize,
}

/// Removes every node whose outputs no kept node and no step output reads, walking backward;
/// communicating nodes stay. Values of removed nodes stay in the table, unreferenced.
pub fn eliminate_dead_code(program: &mut Program) -> DceStats {
    let mut needed = vec![false; program.values.len()];
    for v in program.output_values() {
        needed[v.index()] = true;
    }
    let mut keep = vec![false; program.nodes.len()];
    for (i, node) in program.nodes.iter().enumerate().rev() {
        let used = node.outputs.iter().flatten().any(|v| needed[v.index()]);
        if used || node.communicates() {
            keep[i] = true;
            for v in &node.inputs {
                needed[v.index()] = true;
            }
        }
    }
    let mut stats = DceStats::default();
    let mut new_index = vec![None; program.nodes.len()];
    let mut kept = Vec::with_capacity(program.nodes.len());
    for (i, node) in std::mem::take(&mut program.nodes).into_iter().enumerate() {
        if keep[i] {
            new_index[i] = Some(kept.len());
            kept.push(node);
        } else {
            match node.kind {
                NodeKind::Op(_) => stats.ops += 1,
                NodeKind::Boxing { .. } => stats.boxings += 1,
            }
        }
    }
    program.nodes = kept;
    for v in &mut program.values {
        if let Origin::Node { node, .. } = &mut v.origin {
            *node = new_index[*node].unwrap_or(usize::MAX);
        }
    }
    stats
}

/// Whether value `v` is defined by a node still in the program (or bound from outside).
pub fn is_defined(program: &Program, v: ValueId) -> bool {
    match program.values[v.index()].origin {
        Origin::Node { node, .. } => node < program.nodes.len(),
        Origin::Input(_) | Origin::Constant(_) => true,
    }
}
