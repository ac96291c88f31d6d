//! What a backward rule sees and what its op keeps for it: [`Saves`] (the inputs and outputs an
//! op family declares its backward reads), [`Saved`] (those tensors, kept by the autograd node
//! until its backward runs) and [`Grad`] (the saved tensors behind accessors that refuse what
//! was not declared, every input's metadata, the gradient of every output and which inputs need
//! one), with the tensor constructions several families' rules share.

use std::cell::RefCell;

use oxiflow_sbp::{NdSbp, Shape};

use crate::tensor::{Tensor, TensorMeta};
use crate::{Result, TensorError};

/// Which inputs and outputs of an op call its backward rule reads (bit `i`: input or output
/// `i`; all bits: every one, however many). Everything else reaches the rule as metadata only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Saves {
    inputs: u64,
    outputs: u64,
}

fn bit(i: usize) -> u64 {
    1u64.checked_shl(i as u32).unwrap_or(0)
}

fn has(mask: u64, i: usize) -> bool {
    mask == u64::MAX || mask & bit(i) != 0
}

impl Saves {
    /// Nothing but metadata.
    pub const NOTHING: Saves = Saves {
        inputs: 0,
        outputs: 0,
    };
    /// Every input (whatever their number).
    pub const ALL_INPUTS: Saves = Saves {
        inputs: u64::MAX,
        outputs: 0,
    };
    /// The inputs at `idx`.
    pub fn inputs(idx: &[usize]) -> Saves {
        Saves::NOTHING.and_inputs(idx)
    }
    /// The outputs at `idx`.
    pub fn outputs(idx: &[usize]) -> Saves {
        Saves::NOTHING.and_outputs(idx)
    }
    /// These and the inputs at `idx`.
    pub fn and_inputs(mut self, idx: &[usize]) -> Saves {
        idx.iter().for_each(|&i| self.inputs |= bit(i));
        self
    }
    /// These and the outputs at `idx`.
    pub fn and_outputs(mut self, idx: &[usize]) -> Saves {
        idx.iter().for_each(|&i| self.outputs |= bit(i));
        self
    }
    /// These and input `i` when `on`.
    pub fn and_input_if(self, i: usize, on: bool) -> Saves {
        if on {
            self.and_inputs(&[i])
        } else {
            self
        }
    }
    /// These and output `i` when `on`.
    pub fn and_output_if(self, i: usize, on: bool) -> Saves {
        if on {
            self.and_outputs(&[i])
        } else {
            self
        }
    }
    pub fn input(&self, i: usize) -> bool {
        has(self.inputs, i)
    }
    pub fn output(&self, i: usize) -> bool {
        has(self.outputs, i)
    }
}

/// The tensors a node keeps for its backward rule (detached; None where not declared).
#[derive(Clone, Default)]
pub(crate) struct Saved {
    pub inputs: Vec<Option<Tensor>>,
    pub outputs: Vec<Option<Tensor>>,
}

impl Saved {
    /// Detached copies of the declared inputs and outputs.
    pub fn keep(saves: Saves, inputs: &[&Tensor], outputs: &[Tensor]) -> Saved {
        Saved {
            inputs: inputs
                .iter()
                .enumerate()
                .map(|(i, t)| saves.input(i).then(|| t.detach()))
                .collect(),
            outputs: outputs
                .iter()
                .enumerate()
                .map(|(i, t)| saves.output(i).then(|| t.detach()))
                .collect(),
        }
    }
}

/// The backward context of one recorded op: what a backward rule reads.
pub struct Grad<'a> {
    op: &'a str,
    inputs: &'a [TensorMeta],
    /// None: an earlier backward released them.
    saved: Option<&'a Saved>,
    dys: &'a [Option<Tensor>],
    needs: &'a [bool],
    /// Each input's gradient so far from its other consumers, offered to the rule.
    partials: &'a [RefCell<Option<Tensor>>],
}

impl<'a> Grad<'a> {
    pub(crate) fn new(
        op: &'a str,
        inputs: &'a [TensorMeta],
        saved: Option<&'a Saved>,
        dys: &'a [Option<Tensor>],
        needs: &'a [bool],
    ) -> Self {
        Grad {
            op,
            inputs,
            saved,
            dys,
            needs,
            partials: &[],
        }
    }

    /// These with the inputs' partial gradients `partials` offered (see `take_partial`).
    pub(crate) fn with_partials(self, partials: &'a [RefCell<Option<Tensor>>]) -> Self {
        Grad { partials, ..self }
    }

    /// The gradient input `i` got so far from its other consumers, moved out (None: none
    /// yet, or none offered). A rule that takes it must return input `i`'s gradient with it
    /// added (e.g. as the C operand of its product): the walk keeps that as the sum.
    pub fn take_partial(&self, i: usize) -> Option<Tensor> {
        if !self.need(i) {
            return None;
        }
        self.partials.get(i).and_then(|p| p.borrow_mut().take())
    }

    fn read(
        &self,
        what: &str,
        i: usize,
        pick: fn(&Saved) -> &[Option<Tensor>],
    ) -> Result<&'a Tensor> {
        let Some(saved) = self.saved else {
            return Err(TensorError::Autograd {
                op: "backward",
                detail: format!(
                    "{} released its saved tensors in an earlier backward pass (use \
                     backward_retaining to backpropagate through a graph more than once)",
                    self.op
                ),
            });
        };
        pick(saved)
            .get(i)
            .and_then(Option::as_ref)
            .ok_or_else(|| TensorError::Autograd {
                op: "backward",
                detail: format!(
                    "the backward rule of {} read {what} {i}, which its op does not save \
                     (declare it in the family's `saves`)",
                    self.op
                ),
            })
    }

    /// Saved input `i`; a typed error when the op does not declare it.
    pub fn input(&self, i: usize) -> Result<&'a Tensor> {
        self.read("input", i, |s| &s.inputs)
    }
    /// Saved output `i`; a typed error when the op does not declare it.
    pub fn output(&self, i: usize) -> Result<&'a Tensor> {
        self.read("output", i, |s| &s.outputs)
    }
    /// Metadata of input `i` (shape, dtype, layout), saved or not.
    pub fn input_meta(&self, i: usize) -> &'a TensorMeta {
        &self.inputs[i]
    }
    /// Number of inputs.
    pub fn arity(&self) -> usize {
        self.inputs.len()
    }
    /// The gradient of output 0 (single-output ops run backward only when it has one).
    pub fn dy(&self) -> Result<&'a Tensor> {
        self.dys()
            .first()
            .and_then(Option::as_ref)
            .ok_or_else(|| TensorError::Autograd {
                op: "backward",
                detail: format!("{} got no gradient for its first output", self.op),
            })
    }
    /// The gradient of every output (None: that output got none).
    pub fn dys(&self) -> &'a [Option<Tensor>] {
        self.dys
    }
    /// Whether input `i` needs a gradient.
    pub fn need(&self, i: usize) -> bool {
        self.needs.get(i).copied().unwrap_or(false)
    }
    /// `f()` when input `i` needs a gradient.
    pub fn when(&self, i: usize, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
        if self.need(i) {
            f().map(Some)
        } else {
            Ok(None)
        }
    }
    /// The gradient of the only input.
    pub fn one(g: Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g)])
    }
    /// The error of an op whose gradient is not defined.
    pub fn unsupported(name: &str, why: &str) -> TensorError {
        TensorError::Autograd {
            op: "backward",
            detail: format!("{name} is not differentiable: {why}"),
        }
    }
    /// The error of a backward op asked for its own gradient (a higher-order gradient).
    pub fn higher_order(name: &str) -> TensorError {
        Grad::unsupported(name, "higher-order gradients are not supported")
    }
}

/// Zeros of `shape` with `like`'s dtype, on `like`'s placement (all-B) or local.
pub(crate) fn zeros_on(like: &TensorMeta, shape: Shape) -> Result<Tensor> {
    match (like.placement(), like.context()) {
        (Some(p), Some(ctx)) => {
            let _g = ctx.install();
            Tensor::zeros_global(shape, like.dtype(), p, NdSbp::broadcast(p.ndim()))
        }
        _ => Tensor::try_zeros(shape, like.dtype()),
    }
}

/// Zeros in `like`'s own layout (same shape, dtype, placement, nd-SBP).
pub(crate) fn zeros_like(like: &TensorMeta) -> Result<Tensor> {
    match (like.placement(), like.context(), like.nd_sbp()) {
        (Some(p), Some(ctx), Some(s)) => {
            let _g = ctx.install();
            Tensor::zeros_global(like.shape().clone(), like.dtype(), p, s.clone())
        }
        _ => Tensor::try_zeros(like.shape().clone(), like.dtype()),
    }
}

/// `x`'s shape with `dims` kept as size 1.
pub(crate) fn keepdim_shape(x: &Shape, dims: &[usize]) -> Shape {
    Shape::new(
        x.dims()
            .iter()
            .enumerate()
            .map(|(i, &d)| if dims.contains(&i) { 1 } else { d }),
    )
}

/// The gradient of a broadcast operand: `g` summed down to `like`'s shape.
pub(crate) fn sum_to(g: Tensor, like: &TensorMeta) -> Result<Tensor> {
    g.sum_to_shape(like.shape().clone())
}
