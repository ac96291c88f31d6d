//! Backward-graph nodes and the dispatch hook that records them.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use oxiflow_collectives::DType;
use oxiflow_sbp::NdSbp;

use crate::autograd_slot::{DispatchHook, GradFn};
use crate::op::Op;
use crate::tensor::Tensor;

use super::is_grad_enabled;

/// What a node differentiates.
#[derive(Clone, Debug)]
pub(crate) enum NodeKind {
    /// An op run by `dispatch` (global attributes).
    Op(Op),
    /// `to_global` to (placement, nd-SBP): the identity on values.
    ToGlobal { nd_sbp: NdSbp },
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

impl GradFn for Node {
    fn name(&self) -> &str {
        match &self.kind {
            NodeKind::Op(op) => op.name(),
            NodeKind::ToGlobal { .. } => "to_global",
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64)
}

fn attach(kind: NodeKind, inputs: &[&Tensor], output: &Tensor) {
    let needs: Vec<bool> = inputs
        .iter()
        .map(|t| t.requires_grad() && is_float(t.dtype()))
        .collect();
    if !needs.iter().any(|&b| b) || !is_float(output.dtype()) {
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

/// The hook `enable()` installs: records a node for every op with an input requiring grad.
pub(crate) struct Recorder;

impl DispatchHook for Recorder {
    fn after_op(&self, op: &Op, inputs: &[&Tensor], output: &Tensor) {
        if is_grad_enabled() {
            attach(NodeKind::Op(op.clone()), inputs, output);
        }
    }
}

pub(crate) fn record_to_global(input: &Tensor, output: &Tensor, nd_sbp: &NdSbp) {
    if is_grad_enabled() && !input.same(output) {
        let kind = NodeKind::ToGlobal {
            nd_sbp: nd_sbp.clone(),
        };
        attach(kind, &[input], output);
    }
}
