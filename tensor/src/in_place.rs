//! Writing over a tensor's memory: whether nobody else sees it
//! ([`Tensor::data_held_only_by`]), the device-graph holds that do not count ([`BoundPiece`]),
//! and a local op run into given tensors' pieces instead of new ones ([`run_local_into`]).
//!
//! Tensors are values: an op never changes its operands. An optimizer may still update its
//! parameters and state in the memory they occupy, as torch's does, where nothing but its own
//! handles refers to that memory: then no value anyone else holds changes, and the update needs
//! no second copy of the model's state.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use oxiflow_collectives::trace::{trace_end, trace_start, Lane};
use smallvec::SmallVec;

use crate::capture;
use crate::dispatch::{infer, local_call, Want};
use crate::executor::executor_for;
use crate::op::{Inferred, Op};
use crate::storage::{Device, Storage};
use crate::tensor::{check_not_mixed, devices_text, shapes_text};
use crate::tensor::{Tensor, TensorImpl};
use crate::{Result, TensorError};
use oxiflow_sbp::{RuleMode, Shape};

/// How many [`BoundPiece`]s hold each piece (by its address; a held piece keeps it).
static BOUND: LazyLock<Mutex<HashMap<usize, usize>>> = LazyLock::new(Default::default);

fn key(piece: &Arc<Storage>) -> usize {
    Arc::as_ptr(piece) as usize
}

/// A device graph's hold on a piece it reads at a fixed address and makes current before each
/// launch (it copies a step input's value into it, unless the input is this very piece). Such
/// a hold does not make the piece shared for [`Tensor::data_held_only_by`]: an update written
/// over the piece is what the graph reads at its next launch either way.
pub struct BoundPiece(Arc<Storage>);

impl BoundPiece {
    pub fn new(piece: Arc<Storage>) -> BoundPiece {
        let mut bound = BOUND.lock().unwrap_or_else(|e| e.into_inner());
        *bound.entry(key(&piece)).or_insert(0) += 1;
        BoundPiece(piece)
    }
    /// The piece held.
    pub fn piece(&self) -> &Arc<Storage> {
        &self.0
    }
}

impl Drop for BoundPiece {
    fn drop(&mut self) {
        let mut bound = BOUND.lock().unwrap_or_else(|e| e.into_inner());
        let k = key(&self.0);
        if let Some(n) = bound.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                bound.remove(&k);
            }
        }
    }
}

impl std::fmt::Debug for BoundPiece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BoundPiece({} {})", self.0.dtype(), self.0.shape())
    }
}

/// How many [`BoundPiece`]s hold `piece`.
fn bindings(piece: &Arc<Storage>) -> usize {
    BOUND
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key(piece))
        .copied()
        .unwrap_or(0)
}

impl Tensor {
    /// Whether this tensor and `other` are over this rank's same piece (both without one:
    /// false).
    pub fn shares_piece(&self, other: &Tensor) -> bool {
        match (&self.0.piece, &other.0.piece) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Whether `handles` are every reference there is to their tensors and the only tensors
    /// over their memory: then writing that memory in place changes no value anyone else
    /// holds. Each entry stands for one reference the caller accounts for (list a tensor
    /// twice where it is held twice, say in two fields); every listed tensor must be over the
    /// same piece. A view, a saved copy in an autograd graph, a clone in a caller's hands or a
    /// device graph's output make it false; a device graph's [`BoundPiece`] does not. A
    /// tensor without a piece on this rank has nothing to write: true.
    pub fn data_held_only_by(handles: &[&Tensor]) -> bool {
        let mut inners: SmallVec<[(&Arc<TensorImpl>, usize); 4]> = SmallVec::new();
        for h in handles {
            match inners.iter_mut().find(|(i, _)| Arc::ptr_eq(i, &h.0)) {
                Some((_, n)) => *n += 1,
                None => inners.push((&h.0, 1)),
            }
        }
        if inners.iter().any(|(i, n)| Arc::strong_count(i) != *n) {
            return false;
        }
        let Some((first, _)) = inners.first() else {
            return true;
        };
        let Some(piece) = &first.piece else {
            return inners.iter().all(|(i, _)| i.piece.is_none());
        };
        let same_piece = inners
            .iter()
            .all(|(i, _)| i.piece.as_ref().is_some_and(|p| Arc::ptr_eq(p, piece)));
        same_piece
            && Arc::strong_count(piece) == inners.len() + bindings(piece)
            && match &**piece {
                Storage::Cpu(_) => true,
                Storage::Device(d) => Arc::strong_count(d) == 1 && d.memory_is_its_own(),
            }
    }
}

/// Runs `op` on `inputs` with its outputs written over the memory of `targets` (one per
/// output, of its shape and dtype; for global tensors its layout), which every tensor over that
/// memory then shows, where that changes no value anyone else holds: each target held once, by
/// the caller ([`Tensor::data_held_only_by`]), on a device whose executor runs into given
/// pieces (CUDA), outside a capture (a program records values, not writes), and for global
/// tensors with the signature inference picks taking every input as it is. Returns whether it
/// ran; when not, nothing ran and the caller dispatches the op instead. Metadata errors
/// (shapes, dtypes, placements) come back as errors, the same on every rank.
pub fn dispatch_into(op: Op, inputs: &[&Tensor], targets: &[&Tensor]) -> Result<bool> {
    let all: SmallVec<[&Tensor; 8]> = inputs.iter().chain(targets).copied().collect();
    if all.is_empty() || capture::capturing() {
        return Ok(false);
    }
    let global = all[0].is_global();
    check_not_mixed(op.name(), &all)?;
    let on_device = |t: &Tensor| match t.placement() {
        Some(p) => p.device() != oxiflow_placement::DeviceType::Cpu,
        None => t.device() != Device::Cpu,
    };
    if !all.iter().all(|t| on_device(t)) {
        return Ok(false);
    }
    // Whether the targets are held elsewhere may differ between ranks; the signature does
    // not. A rank that writes in place and one that dispatches the op instead run the same
    // signature, which boxes nothing (else every rank refuses below), so they stay in step.
    if !targets.iter().all(|t| Tensor::data_held_only_by(&[t])) {
        return Ok(false);
    }
    if !global {
        run_local_into(&op, inputs, targets)?;
        return Ok(true);
    }
    let local_op = match crate::dispatch::global_call_into(&op, inputs, targets)? {
        crate::dispatch::CallInto::Refused(why) => {
            tracing::debug!("{} runs into new tensors: {why}", op.name());
            return Ok(false);
        }
        crate::dispatch::CallInto::Outside => return Ok(true),
        crate::dispatch::CallInto::Local(op) => op,
    };
    let ins: SmallVec<[Tensor; 8]> = inputs.iter().map(|t| t.to_local()).collect();
    let outs: SmallVec<[Tensor; 8]> = targets.iter().map(|t| t.to_local()).collect();
    let ins: SmallVec<[&Tensor; 8]> = ins.iter().collect();
    let outs: SmallVec<[&Tensor; 8]> = outs.iter().collect();
    run_local_into(&local_op, &ins, &outs)?;
    Ok(true)
}

/// Runs `op` on the local tensors `inputs` into the pieces of the local tensors `targets` (one
/// per output, of its shape and dtype), which its kernels overwrite: every tensor over those
/// pieces sees the new values (see [`Tensor::data_held_only_by`]). Only on a device whose
/// executor runs into given pieces (CUDA), never under a capture (a program records values,
/// not writes); checked before anything runs. Traced as an op, as dispatch does.
pub fn run_local_into(op: &Op, inputs: &[&Tensor], targets: &[&Tensor]) -> Result<()> {
    let name = op.name();
    let all: SmallVec<[&Tensor; 8]> = inputs.iter().chain(targets).copied().collect();
    let fail = |detail: String| TensorError::Kernel { op: name, detail };
    if all.iter().any(|t| t.is_global()) {
        return Err(fail(
            "an op run into given tensors takes local tensors".into(),
        ));
    }
    let device = all.first().map_or(Device::Cpu, |t| t.device());
    if device == Device::Cpu || all.iter().any(|t| t.device() != device) {
        return Err(TensorError::Device {
            op: name,
            devices: devices_text(&all),
            shapes: shapes_text(&all),
            detail: "an op runs into given tensors on one device other than the host".into(),
        });
    }
    if capture::capturing() {
        return Err(TensorError::Capture {
            op: name,
            detail: "an op run into given tensors writes memory a program does not own".into(),
        });
    }
    let Inferred { rules, dtypes } = infer(op, inputs, RuleMode::ShapesOnly, Want::All)?;
    let outs = rules.out_shapes();
    let fits = outs.len() == targets.len()
        && outs
            .iter()
            .zip(&dtypes)
            .zip(targets)
            .all(|((s, d), t)| t.shape() == s && t.dtype() == *d);
    if !fits {
        return Err(TensorError::Shape {
            op: name,
            shapes: shapes_text(targets),
            sbps: String::new(),
            detail: format!(
                "the outputs are {} but the targets are {}",
                outs.iter()
                    .zip(&dtypes)
                    .map(|(s, d)| format!("{d} {s}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                targets
                    .iter()
                    .map(|t| t.describe())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    let pieces = storages(name, inputs)?;
    let into = storages(name, targets)?;
    let shapes: SmallVec<[&Shape; 8]> = inputs.iter().map(|t| t.shape()).collect();
    let local = outs.first().and_then(|o| local_call(op, &shapes, o));
    let traced = trace_start();
    executor_for(name, device)?.run_into(local.as_ref().unwrap_or(op), &pieces, &into)?;
    trace_end(
        traced,
        Lane::Ops,
        || std::borrow::Cow::Borrowed(name),
        || vec![("inputs", shapes_text(inputs).into())],
    );
    Ok(())
}

/// Each tensor's piece.
fn storages<'a>(op: &'static str, ts: &[&'a Tensor]) -> Result<SmallVec<[&'a Storage; 8]>> {
    ts.iter()
        .map(|t| {
            t.storage().ok_or_else(|| TensorError::Kernel {
                op,
                detail: "a local tensor without storage".into(),
            })
        })
        .collect()
}
