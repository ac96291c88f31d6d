//! Backward-graph nodes: how they are recorded and how each runs its backward rule.

use std::fmt;
use std::sync::Arc;

use oxiflow_sbp::{NdSbp, Sbp};

use crate::op::{Grad, Op};
use crate::tensor::Tensor;
use crate::Result;

use super::is_grad_enabled;
use super::recompute::{self, Block};

/// What a node differentiates.
#[derive(Clone, Debug)]
pub(crate) enum NodeKind {
    /// An op run by `dispatch` (global attributes).
    Op(Op),
    /// `to_global` to (placement, nd-SBP): the identity on values.
    ToGlobal { nd_sbp: NdSbp },
    /// A block run again in the backward pass (see `recompute`).
    Recompute(Block),
}

/// One recorded op: its inputs (the graph's edges), a detached copy of its output, and which
/// inputs need a gradient.
pub struct Node {
    pub(crate) kind: NodeKind,
    pub(crate) inputs: Vec<Tensor>,
    pub(crate) output: Tensor,
    pub(crate) needs: Vec<bool>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node({}, {} inputs)", self.name(), self.inputs.len())
    }
}

impl Node {
    /// The op the node differentiates.
    pub fn name(&self) -> &str {
        match &self.kind {
            NodeKind::Op(op) => op.name(),
            NodeKind::ToGlobal { .. } => "to_global",
            NodeKind::Recompute(_) => "recompute",
        }
    }
    /// Input gradients given the gradient `dy` of the output (None where not needed).
    pub(crate) fn backward(&self, dy: &Tensor) -> Result<Vec<Option<Tensor>>> {
        if let NodeKind::Recompute(block) = &self.kind {
            return recompute::backward(block, &self.inputs, &self.needs, dy);
        }
        let x: Vec<Tensor> = self.inputs.iter().map(Tensor::detach).collect();
        match &self.kind {
            NodeKind::ToGlobal { nd_sbp } => Ok(vec![Some(to_global_backward(&x[0], dy, nd_sbp)?)]),
            NodeKind::Op(op) => op.backward(&Grad::new(&x, &self.output, dy, &self.needs)),
            NodeKind::Recompute(_) => Ok(vec![None; x.len()]),
        }
    }
}

/// Makes `kind` `output`'s node when an input requires a (float) gradient, or always when
/// `always` (a recompute block whose captured parameters require one).
pub(crate) fn attach(kind: NodeKind, inputs: &[&Tensor], output: &Tensor, always: bool) {
    let needs: Vec<bool> = inputs
        .iter()
        .map(|t| t.requires_grad() && t.dtype().is_float())
        .collect();
    if !(always || needs.iter().any(|&b| b)) || !output.dtype().is_float() {
        return;
    }
    let node = Node {
        kind,
        inputs: inputs.iter().map(|t| (*t).clone()).collect(),
        output: output.detach(),
        needs,
    };
    output.autograd().set_requires_grad(true);
    output.autograd().set_grad_fn(Some(Arc::new(node)));
}

/// Records `op` as `output`'s node when grad mode is on and an input requires a gradient.
pub(crate) fn record_op(op: Op, inputs: &[&Tensor], output: &Tensor) {
    if is_grad_enabled() {
        attach(NodeKind::Op(op), inputs, output, false);
    }
}

pub(crate) fn record_to_global(input: &Tensor, output: &Tensor, nd_sbp: &NdSbp) {
    if is_grad_enabled() && !input.same(output) {
        let kind = NodeKind::ToGlobal {
            nd_sbp: nd_sbp.clone(),
        };
        attach(kind, &[input], output, false);
    }
}

/// Gradient of `to_global`: the output gradient boxed back to the input's layout. A local input
/// (this rank's piece) gets its piece of the gradient, partial-sum axes read as broadcast.
fn to_global_backward(x: &Tensor, dy: &Tensor, target: &NdSbp) -> Result<Tensor> {
    if let (Some(p), Some(s)) = (x.placement(), x.nd_sbp()) {
        return dy.to_global(p, s.clone());
    }
    let Some(p) = dy.placement() else {
        return Ok(dy.clone());
    };
    let piece_sbp = NdSbp::new(
        target
            .iter()
            .map(|s| if s.is_partial() { Sbp::B } else { s }),
    );
    Ok(dy.to_global(p, piece_sbp)?.to_local())
}
