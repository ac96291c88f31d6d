//! Replay of a rank's program on the host executor seam: step inputs and constants bound to
//! their values, every node in the captured order (kernels through the device's executor into
//! buffers allocated per the plan, boxing plans through the communicator, so collectives run in
//! the recorded order on every rank), each value dropped after its last read, and the step's
//! outputs rebuilt as tensors of their captured layouts.

use std::sync::Arc;

use oxiflow_tensor::capture::{piece_of, run_boxing, run_local_kernel, tensor_from_piece};
use oxiflow_tensor::{Storage, Tensor};

use crate::error::{CompileError, Result};
use crate::ir::{NodeKind, Origin, Program, StepKey, ValueId};
use crate::passes::liveness::Liveness;

/// Runs `program` on `inputs` (which must have its key) and returns the step's outputs.
pub fn replay(program: &Program, live: &Liveness, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let key = StepKey::of(inputs);
    if key != program.key {
        return Err(CompileError::Inputs {
            detail: key.changes_from(&program.key),
        });
    }
    let mut table: Vec<Option<Arc<Storage>>> = vec![None; program.values.len()];
    for (i, v) in program.values.iter().enumerate() {
        table[i] = match v.origin {
            Origin::Input(k) => {
                Some(inputs.get(k).and_then(piece_of).cloned().ok_or_else(|| {
                    CompileError::Inputs {
                        detail: format!("input {k} has no piece on this rank"),
                    }
                })?)
            }
            Origin::Constant(c) => program.constants.get(c).cloned(),
            Origin::Node { .. } => None,
        };
    }
    let missing = |node: usize, op: &'static str, v: ValueId| CompileError::Replay {
        node,
        op,
        detail: format!("value {v} is not there"),
    };
    for (i, node) in program.nodes.iter().enumerate() {
        match &node.kind {
            // Outside the placement the op runs nothing.
            NodeKind::Op(o) if o.out_specs.is_none() => {}
            NodeKind::Op(o) => {
                let specs = o.out_specs.as_deref().unwrap_or_default();
                let local_op = &o.local_op;
                let mut pieces: Vec<&Storage> = Vec::with_capacity(node.inputs.len());
                for v in &node.inputs {
                    let p = table[v.index()]
                        .as_deref()
                        .ok_or_else(|| missing(i, node.name(), *v))?;
                    pieces.push(p);
                }
                let outs = run_local_kernel(local_op, &pieces, node.device, specs)?;
                if outs.len() != node.outputs.len() {
                    return Err(CompileError::Replay {
                        node: i,
                        op: node.name(),
                        detail: format!(
                            "{} output pieces for {} outputs",
                            outs.len(),
                            node.outputs.len()
                        ),
                    });
                }
                for (out, v) in outs.into_iter().zip(&node.outputs) {
                    if let Some(v) = v {
                        table[v.index()] = Some(Arc::new(out));
                    }
                }
            }
            NodeKind::Boxing { op, plan } => {
                let ctx = program.ctx.as_ref().ok_or_else(|| CompileError::Replay {
                    node: i,
                    op,
                    detail: "a boxing without a runtime context".into(),
                })?;
                let input = match node.inputs.first() {
                    Some(v) => Some(table[v.index()].clone().ok_or_else(|| missing(i, op, *v))?),
                    None => None,
                };
                let out = run_boxing(op, plan, ctx, input.as_ref(), node.device)?;
                match (node.outputs.first().copied().flatten(), out) {
                    (Some(v), Some(p)) => table[v.index()] = Some(p),
                    (None, None) => {}
                    (want, got) => {
                        return Err(CompileError::Replay {
                            node: i,
                            op,
                            detail: format!(
                                "the capture {} a piece, the replay {}",
                                if want.is_some() { "had" } else { "had no" },
                                if got.is_some() {
                                    "made one"
                                } else {
                                    "made none"
                                }
                            ),
                        })
                    }
                }
            }
        }
        if let Some(done) = live.release_after.get(i) {
            for v in done {
                table[v.index()] = None;
            }
        }
    }
    program
        .outputs
        .iter()
        .enumerate()
        .map(|(k, o)| {
            let piece = match o.value {
                Some(v) => Some(
                    table[v.index()]
                        .clone()
                        .ok_or_else(|| CompileError::Replay {
                            node: program.nodes.len(),
                            op: "output",
                            detail: format!("step output {k} ({v}) is not there"),
                        })?,
                ),
                None => None,
            };
            Ok(tensor_from_piece(
                piece,
                o.global.as_ref().map(|(l, c)| (l, c)),
                o.dtype,
            )?)
        })
        .collect()
}
