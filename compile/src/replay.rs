//! Replay of a rank's program from its arena: step inputs and constants bound to their values,
//! every buffer the program writes placed at its planned offset in one arena (allocated once
//! per program and rank, reused by every replay), every node in the captured order: kernels
//! through the device's executor straight into their placed outputs, views as views of their
//! source's bytes, boxing plans through the communicator (so collectives run in the recorded
//! order on every rank) with their results written into their places (a collective's result
//! has none: it stays the collective's own piece, see `passes::liveness`); each value dropped after
//! its last read, and the step's outputs (allocated, not placed: they outlive the replay)
//! rebuilt as tensors of their captured layouts.
//!
//! A boxing reads a copy of a placed input: the communicator may keep its input past the call,
//! and a placed piece must not outlive its place. A boxing whose plan only relabels (every
//! rank keeps its piece) gives a view of its input instead, with no copy and no call. A buffer the plan has no place for on the
//! arena's device (a node writing a piece on another device) is allocated as eager dispatch
//! does.

use std::sync::Arc;

use oxiflow_boxing::StepKind;
use oxiflow_tensor::arena::{run_kernel_into, Arena, PlacedPiece};
use oxiflow_tensor::capture::{piece_of, run_boxing, run_local_kernel, tensor_from_piece};
use oxiflow_tensor::{Device, OutSpec, Storage, Tensor, ViewOf};
use smallvec::SmallVec;

use crate::error::{CompileError, Result};
use crate::ir::{Node, NodeKind, Origin, Program, StepKey, ValueId};
use crate::passes::arena::{ArenaPlan, ARENA_ALIGN};
use crate::passes::liveness::Liveness;

/// A value during a replay.
enum Slot {
    /// A piece outside the arena: a step input, a constant, or one allocated for a buffer
    /// without a place.
    Held(Arc<Storage>),
    /// A piece at its planned place in the arena.
    Placed(PlacedPiece),
}

impl Slot {
    fn storage(&self) -> Result<&Storage> {
        match self {
            Slot::Held(s) => Ok(s),
            Slot::Placed(p) => Ok(p.storage()?),
        }
    }
    /// The piece as a shared storage: itself when held, a copy when placed.
    fn shared(&self) -> Result<Arc<Storage>> {
        match self {
            Slot::Held(s) => Ok(s.clone()),
            Slot::Placed(p) => Ok(Arc::new(p.to_owned_storage()?)),
        }
    }
}

/// The device of the program's arena: that of the buffers it places (the first one's).
pub fn arena_device(program: &Program, plan: &ArenaPlan) -> Device {
    plan.placed.first().map_or(Device::Cpu, |p| {
        program.values[p.life.buffer.index()].device
    })
}

/// Each value's planned offset (None: no place of its own; an alias has its buffer's, moved by
/// the byte offsets along its chain, and none where that is not a place's alignment: a node
/// writing such a value gets a buffer of its own, as eager's host copy of a view is). The
/// buffers of the step's outputs are allocated as eager dispatch does instead: they outlive
/// the replay, and a placed one would be copied out.
fn offsets(program: &Program, plan: &ArenaPlan) -> Vec<Option<usize>> {
    let mut own = vec![None; program.values.len()];
    for p in &plan.placed {
        own[p.life.buffer.index()] = Some(p.offset);
    }
    for o in &program.outputs {
        if let Some(v) = o.value {
            own[program.buffer_of(v).index()] = None;
        }
    }
    (0..program.values.len())
        .map(|i| {
            let (mut v, mut at) = (ValueId(i as u32), 0);
            while let Some(a) = program.values[v.index()].alias_of {
                at += program.values[v.index()].alias_at;
                v = a;
            }
            own[v.index()]
                .map(|o| o + at)
                .filter(|o| o.is_multiple_of(ARENA_ALIGN))
        })
        .collect()
}

struct Replay<'a> {
    program: &'a Program,
    arena: &'a Arena,
    offsets: Vec<Option<usize>>,
    table: Vec<Option<Slot>>,
}

impl Replay<'_> {
    fn missing(&self, node: usize, v: ValueId) -> CompileError {
        CompileError::Replay {
            node,
            op: self.program.nodes[node].name(),
            detail: format!("value {v} is not there"),
        }
    }

    fn slot(&self, node: usize, v: ValueId) -> Result<&Slot> {
        self.table[v.index()]
            .as_ref()
            .ok_or_else(|| self.missing(node, v))
    }

    /// The place of value `v` of `spec` in the arena, when it has one there.
    fn place(&self, v: ValueId, spec: &OutSpec) -> Result<Option<PlacedPiece>> {
        let value = &self.program.values[v.index()];
        match self.offsets[v.index()] {
            Some(offset) if value.device == self.arena.device() => {
                Ok(Some(self.arena.place(offset, spec)?))
            }
            _ => Ok(None),
        }
    }

    fn spec_of(&self, v: ValueId) -> OutSpec {
        let value = &self.program.values[v.index()];
        OutSpec {
            shape: value.shape.clone(),
            dtype: value.dtype,
        }
    }

    fn run_op(
        &mut self,
        i: usize,
        node: &Node,
        view_of: Option<ViewOf>,
        specs: &[OutSpec],
    ) -> Result<()> {
        let NodeKind::Op(o) = &node.kind else {
            return Ok(());
        };
        // A view of a placed piece is a view of its bytes.
        if let (Some(k), [spec], [Some(out)]) = (view_of, specs, node.outputs.as_slice()) {
            if let Some(src) = node.inputs.get(k.input) {
                if let Slot::Placed(p) = self.slot(i, *src)? {
                    let view = p.view_at(self.program.values[out.index()].alias_at, spec)?;
                    self.table[out.index()] = Some(Slot::Placed(view));
                    return Ok(());
                }
            }
        }
        let mut places: SmallVec<[PlacedPiece; 1]> = SmallVec::new();
        if view_of.is_none() && specs.len() == node.outputs.len() {
            for (spec, v) in specs.iter().zip(&node.outputs) {
                match v {
                    Some(v) => match self.place(*v, spec)? {
                        Some(p) => places.push(p),
                        None => break,
                    },
                    None => break,
                }
            }
        }
        let mut pieces: SmallVec<[&Storage; 3]> = SmallVec::with_capacity(node.inputs.len());
        for v in &node.inputs {
            pieces.push(self.slot(i, *v)?.storage()?);
        }
        let made: SmallVec<[Slot; 1]> = if places.len() == specs.len() && !specs.is_empty() {
            run_kernel_into(&o.local_op, &pieces, node.device, &mut places)?;
            places.into_iter().map(Slot::Placed).collect()
        } else {
            let outs = run_local_kernel(&o.local_op, &pieces, node.device, specs)?;
            outs.into_iter().map(|s| Slot::Held(Arc::new(s))).collect()
        };
        drop(pieces);
        if made.len() != node.outputs.len() {
            return Err(CompileError::Replay {
                node: i,
                op: node.name(),
                detail: format!(
                    "{} output pieces for {} outputs",
                    made.len(),
                    node.outputs.len()
                ),
            });
        }
        for (slot, v) in made.into_iter().zip(&node.outputs) {
            if let Some(v) = v {
                self.table[v.index()] = Some(slot);
            }
        }
        Ok(())
    }

    fn run_boxing(&mut self, i: usize, node: &Node) -> Result<()> {
        let NodeKind::Boxing { op, plan } = &node.kind else {
            return Ok(());
        };
        let ctx = self
            .program
            .ctx
            .as_ref()
            .ok_or_else(|| CompileError::Replay {
                node: i,
                op,
                detail: "a boxing without a runtime context".into(),
            })?;
        let input_value = node.inputs.first().copied();
        // A plan of relabels only leaves every rank's piece as it is (the same plan on every
        // rank, so no rank communicates): the output, recorded as an alias of the input, is
        // the input's bytes, with no copy.
        if plan
            .steps
            .iter()
            .all(|s| matches!(s.kind, StepKind::Relabel))
        {
            let out = node.outputs.first().copied().flatten();
            if let (Some(src), Some(v)) = (input_value, out) {
                if self.program.values[v.index()].alias_of != Some(src) {
                    return Err(CompileError::Replay {
                        node: i,
                        op,
                        detail: format!("relabel output {v} was not recorded as its input {src}"),
                    });
                }
                let slot = match self.slot(i, src)? {
                    Slot::Placed(p) => Slot::Placed(p.view_at(0, &self.spec_of(v))?),
                    Slot::Held(s) => Slot::Held(s.clone()),
                };
                self.table[v.index()] = Some(slot);
                return Ok(());
            }
        }
        let input = match input_value {
            Some(v) => Some(self.slot(i, v)?.shared()?),
            None => None,
        };
        let out = run_boxing(op, plan, ctx, input.as_ref(), node.device)?;
        let (v, piece) = match (node.outputs.first().copied().flatten(), out) {
            (Some(v), Some(p)) => (v, p),
            (None, None) => return Ok(()),
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
        };
        let value = &self.program.values[v.index()];
        let slot = match (value.alias_of, input_value) {
            // The plan left the piece as it was: the output is the input's bytes.
            (Some(a), Some(src)) if a == src => match self.slot(i, src)? {
                Slot::Placed(p) => Slot::Placed(p.view_at(0, &self.spec_of(v))?),
                Slot::Held(_) => Slot::Held(piece),
            },
            _ => match self.place(v, &self.spec_of(v))? {
                Some(mut p) => {
                    p.write_from(&piece)?;
                    Slot::Placed(p)
                }
                None => Slot::Held(piece),
            },
        };
        self.table[v.index()] = Some(slot);
        Ok(())
    }
}

/// Runs `program` on `inputs` (which must have its key) with its buffers at `plan`'s places in
/// `arena` (on the device [`arena_device`] names, of at least `plan.bytes` bytes, used by no
/// other replay at the same time), and returns the step's outputs.
pub fn replay(
    program: &Program,
    live: &Liveness,
    plan: &ArenaPlan,
    arena: &Arena,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>> {
    let key = StepKey::of(inputs, program.key.matmul);
    if key != program.key {
        return Err(CompileError::Inputs {
            detail: key.changes_from(&program.key),
        });
    }
    if arena.bytes() < plan.bytes {
        return Err(CompileError::Inputs {
            detail: format!(
                "an arena of {} bytes for a plan of {} bytes",
                arena.bytes(),
                plan.bytes
            ),
        });
    }
    let mut r = Replay {
        program,
        arena,
        offsets: offsets(program, plan),
        table: Vec::with_capacity(program.values.len()),
    };
    for v in &program.values {
        r.table.push(match v.origin {
            Origin::Input(k) => {
                Some(Slot::Held(
                    inputs.get(k).and_then(piece_of).cloned().ok_or_else(|| {
                        CompileError::Inputs {
                            detail: format!("input {k} has no piece on this rank"),
                        }
                    })?,
                ))
            }
            Origin::Constant(c) => program.constants.get(c).cloned().map(Slot::Held),
            Origin::Node { .. } => None,
        });
    }
    for (i, node) in program.nodes.iter().enumerate() {
        match &node.kind {
            // Outside the placement the op runs nothing.
            NodeKind::Op(o) => {
                if let Some(specs) = o.out_specs.as_deref() {
                    r.run_op(i, node, o.view_of, specs)?;
                }
            }
            NodeKind::Boxing { .. } => r.run_boxing(i, node)?,
        }
        if let Some(done) = live.release_after.get(i) {
            for v in done {
                r.table[v.index()] = None;
            }
        }
    }
    // Outputs that share a value share its one copy.
    let mut copies: Vec<(ValueId, Arc<Storage>)> = Vec::new();
    let pieces = program
        .outputs
        .iter()
        .enumerate()
        .map(|(k, o)| {
            let Some(v) = o.value else {
                return Ok(None);
            };
            if let Some((_, p)) = copies.iter().find(|(c, _)| *c == v) {
                return Ok(Some(p.clone()));
            }
            let p = r.table[v.index()]
                .as_ref()
                .ok_or_else(|| CompileError::Replay {
                    node: program.nodes.len(),
                    op: "output",
                    detail: format!("step output {k} ({v}) is not there"),
                })?
                .shared()?;
            copies.push((v, p.clone()));
            Ok(Some(p))
        })
        .collect::<Result<Vec<_>>>()?;
    output_tensors(program, &pieces)
}

/// The step's outputs over `pieces` (one per output of `program`, None outside its
/// placement), in their captured layouts.
pub(crate) fn output_tensors(
    program: &Program,
    pieces: &[Option<Arc<Storage>>],
) -> Result<Vec<Tensor>> {
    program
        .outputs
        .iter()
        .zip(pieces)
        .map(|(o, piece)| {
            Ok(tensor_from_piece(
                piece.clone(),
                o.global.as_ref().map(|(l, c)| (l, c)),
                o.dtype,
            )?)
        })
        .collect()
}
