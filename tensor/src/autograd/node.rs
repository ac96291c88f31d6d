//! Backward-graph nodes: what one records (edges to the producers of its inputs, the metadata
//! of its inputs and outputs, and only the tensors its backward rule declared) and how each runs
//! its backward rule, releasing those tensors as it does.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use oxiflow_sbp::{NdSbp, Sbp};
use smallvec::SmallVec;

use crate::grad_mode::is_grad_enabled;
use crate::op::{Grad, Op, Saved, Saves};
use crate::tensor::{GradFn, Tensor, TensorImpl, TensorMeta};
use crate::Result;

/// What a node differentiates.
#[derive(Clone, Debug)]
pub(crate) enum NodeKind {
    /// An op run by `dispatch` (global attributes).
    Op(Op),
    /// `to_global` to (placement, nd-SBP): the identity on values.
    ToGlobal { nd_sbp: NdSbp },
    /// A block run again in the backward pass (see `recompute`).
    Recompute(Arc<dyn Rerun>),
}

/// A block a recompute node runs again in its backward, backpropagating through that second
/// run (see `recompute`).
pub(crate) trait Rerun: Send + Sync + fmt::Debug {
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>>;
}

impl NodeKind {
    /// The inputs and outputs the backward reads (a recompute block reruns on its inputs).
    fn saves(&self, needs: &[bool]) -> Saves {
        match self {
            NodeKind::Op(op) => op.saves(needs),
            NodeKind::ToGlobal { .. } => Saves::NOTHING,
            NodeKind::Recompute(_) => Saves::ALL_INPUTS,
        }
    }
    /// Whether output `i` carries a gradient.
    fn differentiable(&self, i: usize) -> bool {
        match self {
            NodeKind::Op(op) => op.differentiable(i),
            NodeKind::ToGlobal { .. } | NodeKind::Recompute(_) => true,
        }
    }
}

/// Where the gradient of one input goes: the node that produced it (and which of its outputs
/// the input is), or the leaf itself, whose grad slot accumulates it. A graph does not keep
/// its leaves alive: a leaf nobody holds any more has nobody to read its gradient, which is
/// then dropped; and a leaf's memory stays its holders' alone (an optimizer may update a
/// parameter in place while the loss that reached it still lives).
pub(crate) enum Edge {
    Node(Arc<Node>, usize),
    Leaf(Weak<TensorImpl>),
}

/// The tensors a node keeps, until its backward runs.
enum Kept {
    Saved(Saved),
    Released,
}

/// One recorded op: edges to its inputs' producers (None where an input needs no gradient),
/// the metadata of its inputs and outputs, and the tensors its backward rule declared (see
/// `OpFamily::saves`), released when the node's backward runs.
pub struct Node {
    pub(crate) kind: NodeKind,
    pub(crate) edges: Vec<Option<Edge>>,
    pub(crate) inputs: Vec<TensorMeta>,
    pub(crate) outputs: Vec<TensorMeta>,
    kept: Mutex<Kept>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Node({}, {} inputs, {} outputs)",
            self.name(),
            self.inputs.len(),
            self.outputs.len()
        )
    }
}

impl GradFn for Node {
    fn name(&self) -> &str {
        match &self.kind {
            NodeKind::Op(op) => op.name(),
            NodeKind::ToGlobal { .. } => "to_global",
            NodeKind::Recompute(_) => "recompute",
        }
    }
    fn saved_count(&self) -> usize {
        match &*self.kept.lock().unwrap_or_else(|e| e.into_inner()) {
            Kept::Saved(s) => s.inputs.iter().chain(&s.outputs).flatten().count(),
            Kept::Released => 0,
        }
    }
}

/// The node that made `t` (every node is one of this engine's) and which of its outputs `t` is.
pub(crate) fn node_edge(t: &Tensor) -> Option<(Arc<Node>, usize)> {
    let (f, i) = t.autograd().grad_edge()?;
    let any: Arc<dyn std::any::Any + Send + Sync> = f;
    any.downcast::<Node>().ok().map(|n| (n, i))
}

impl Node {
    /// Which inputs need a gradient.
    pub(crate) fn needs(&self) -> Vec<bool> {
        self.edges.iter().map(Option::is_some).collect()
    }
    /// Input gradients given the gradients of the outputs (None where an output got none, or
    /// where an input needs none). Releases the saved tensors unless `retain`.
    pub(crate) fn backward(
        &self,
        dys: &[Option<Tensor>],
        retain: bool,
        partials: &[std::cell::RefCell<Option<Tensor>>],
    ) -> Result<Vec<Option<Tensor>>> {
        let saved = {
            let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            match &*kept {
                Kept::Released => None,
                Kept::Saved(s) if retain => Some(s.clone()),
                Kept::Saved(_) => match std::mem::replace(&mut *kept, Kept::Released) {
                    Kept::Saved(s) => Some(s),
                    Kept::Released => None,
                },
            }
        };
        let needs = self.needs();
        let g = Grad::new(self.name(), &self.inputs, saved.as_ref(), dys, &needs)
            .with_partials(partials);
        match &self.kind {
            NodeKind::Op(op) => op.backward(&g),
            NodeKind::ToGlobal { nd_sbp } => Ok(vec![Some(to_global_backward(
                g.input_meta(0),
                g.dy()?,
                nd_sbp,
            )?)]),
            NodeKind::Recompute(block) => block.backward(&g),
        }
    }
}

/// Makes `kind` the node of `outputs` (those of a float dtype that carry a gradient) when an
/// input requires a (float) gradient, or always when `always` (a recompute block whose
/// captured parameters require one). The node keeps the tensors its kind's backward reads.
pub(crate) fn attach(kind: NodeKind, inputs: &[&Tensor], outputs: &[Tensor], always: bool) {
    let wants = |t: &&Tensor| t.requires_grad() && t.dtype().is_float();
    if !(always || inputs.iter().any(wants)) {
        return;
    }
    let carries: SmallVec<[bool; 3]> = outputs
        .iter()
        .enumerate()
        .map(|(i, o)| o.dtype().is_float() && kind.differentiable(i))
        .collect();
    if !carries.contains(&true) {
        return;
    }
    let edges: Vec<Option<Edge>> = inputs
        .iter()
        .map(|t| {
            wants(t).then(|| match node_edge(t) {
                Some((n, i)) => Edge::Node(n, i),
                None => Edge::Leaf(Arc::downgrade(&t.0)),
            })
        })
        .collect();
    let needs: Vec<bool> = edges.iter().map(Option::is_some).collect();
    let saved = Saved::keep(kind.saves(&needs), inputs, outputs);
    let node = Arc::new(Node {
        kind,
        edges,
        inputs: inputs.iter().map(|t| t.meta()).collect(),
        outputs: outputs.iter().map(Tensor::meta).collect(),
        kept: Mutex::new(Kept::Saved(saved)),
    });
    for (i, (o, &carry)) in outputs.iter().zip(&carries).enumerate() {
        if carry {
            o.autograd().set_requires_grad(true);
            o.autograd()
                .set_grad_fn(Some((node.clone() as Arc<dyn GradFn>, i)));
        }
    }
}

/// Records `op` as the node of `outputs` when grad mode is on and an input requires a gradient.
pub(crate) fn record_op(op: &Op, inputs: &[&Tensor], outputs: &[Tensor]) {
    if is_grad_enabled() && inputs.iter().any(|t| t.requires_grad()) {
        attach(NodeKind::Op(op.clone()), inputs, outputs, false);
    }
}

pub(crate) fn record_to_global(input: &Tensor, output: &Tensor, nd_sbp: &NdSbp) {
    if is_grad_enabled() && !input.same(output) {
        let kind = NodeKind::ToGlobal {
            nd_sbp: nd_sbp.clone(),
        };
        let out = [output.clone()];
        attach(kind, &[input], &out, false);
    }
}

/// Gradient of `to_global`: the output gradient boxed back to the input's layout. A local input
/// (this rank's piece) gets its piece of the gradient, partial-sum axes read as broadcast.
fn to_global_backward(x: &TensorMeta, dy: &Tensor, target: &NdSbp) -> Result<Tensor> {
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Weak};

    use oxiflow_dtype::DType;

    use crate::storage::Storage;
    use crate::Tensor;

    fn piece(t: &Tensor) -> Weak<Storage> {
        Arc::downgrade(t.0.piece.as_ref().expect("a local tensor has a piece"))
    }

    #[test]
    fn nodes_keep_only_what_backward_reads_and_release_it_there() {
        let x = Tensor::randn([64, 32], 1, DType::F64).requires_grad_(true);
        let w = Tensor::randn([32, 16], 2, DType::F64).requires_grad_(true);
        // a: scaled (saves nothing), so nothing but `a` itself holds its data.
        let a = x.mul_scalar(2.0).unwrap();
        let a_data = piece(&a);
        // h = a @ w saves a (for dw) and w (for da); e = exp(h) saves its output.
        let h = a.matmul(&w).unwrap();
        let h_data = piece(&h);
        let e = h.exp().unwrap();
        let e_data = piece(&e);
        let loss = e.sum_all().unwrap();
        drop((a, h, e));
        assert!(a_data.upgrade().is_some(), "matmul saves its input a");
        assert!(
            h_data.upgrade().is_none(),
            "exp saves its output, not its input"
        );
        assert!(e_data.upgrade().is_some(), "exp saves its output");
        let sum_node = loss.autograd().grad_fn().unwrap();
        assert_eq!(sum_node.saved_count(), 0, "sum keeps shapes only");
        loss.backward().unwrap();
        assert!(
            a_data.upgrade().is_none(),
            "matmul released a in its backward"
        );
        assert!(
            e_data.upgrade().is_none(),
            "exp released its output in its backward"
        );
        assert!(x.grad().is_some() && w.grad().is_some());
        // The graph is still there, its saved tensors are not: a second pass is refused.
        let err = loss.backward().unwrap_err().to_string();
        assert!(err.contains("exp") && err.contains("released"), "{err}");
    }

    #[test]
    fn matmul_keeps_an_operand_only_for_the_others_gradient() {
        let x = Tensor::randn([8, 4], 3, DType::F64);
        let w = Tensor::randn([4, 2], 4, DType::F64).requires_grad_(true);
        let x_data = piece(&x);
        let w_data = piece(&w);
        let y = x.matmul(&w).unwrap();
        drop((x, w));
        let node = y.autograd().grad_fn().unwrap();
        assert_eq!(node.saved_count(), 1);
        assert!(x_data.upgrade().is_some(), "dw reads x");
        // w is the leaf: neither the saved set nor the edge holds it (dropped, its gradient
        // has no reader, and the pass drops it).
        assert!(w_data.upgrade().is_none());
        y.sum_all().unwrap().backward().unwrap();
        assert!(x_data.upgrade().is_none());
    }
}
