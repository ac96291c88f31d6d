//! The backward pass: topological order of the nodes reachable from the root, one backward
//! rule per node (given one gradient per output), gradient accumulation into the leaves' grad
//! slots as soon as a leaf's last incoming edge has been walked (the thread's
//! [`GradReadyHook`](super::GradReadyHook) hears of it then). A node's saved tensors are
//! released as its backward runs (their last use). A rule may add an input's gradient so far
//! into its own (`Grad::take_partial`), saving the add.

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use oxiflow_sbp::{NdSbp, Shape};
use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use crate::context::Context;
use crate::tensor::{Tensor, TensorImpl};
use crate::{Result, TensorError};

use super::hook::{self, GradReadyHook};
use super::no_grad;
use super::node::{node_edge, Edge, Node};
use crate::tensor::GradFn;

fn key(f: &Arc<Node>) -> usize {
    Arc::as_ptr(f) as usize
}

/// `Ok` when the shapes `got` and `want` are equal, else an autograd error of `op` saying
/// `detail()`.
pub(super) fn same_shape(
    op: &'static str,
    got: &Shape,
    want: &Shape,
    detail: impl FnOnce() -> String,
) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(TensorError::Autograd {
            op,
            detail: detail(),
        })
    }
}

/// Ones with `t`'s shape, dtype and placement (the default seed gradient).
fn ones_like(t: &Tensor) -> Result<Tensor> {
    match (t.placement(), t.context()) {
        (Some(p), Some(ctx)) => {
            let _g = ctx.install();
            Tensor::ones_global(t.shape().clone(), t.dtype(), p, NdSbp::broadcast(p.ndim()))
        }
        _ => Tensor::try_ones(t.shape().clone(), t.dtype()),
    }
}

/// Adds `g` into `slot` (another gradient of the same tensor).
pub(crate) fn accumulate(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        Some(prev) => prev.add(&g)?,
        None => g,
    });
    Ok(())
}

/// Nodes reachable from `root`, each once, in reverse topological order (consumers first).
fn topo_order(root: &Arc<Node>) -> Vec<Arc<Node>> {
    let mut post: Vec<Arc<Node>> = Vec::new();
    let mut seen: FxHashSet<usize> = FxHashSet::default();
    // (node, next edge index to visit)
    let mut stack: Vec<(Arc<Node>, usize)> = vec![(root.clone(), 0)];
    seen.insert(key(root));
    while let Some((f, i)) = stack.pop() {
        if i < f.edges.len() {
            let next = match &f.edges[i] {
                Some(Edge::Node(n, _)) => Some(n.clone()),
                _ => None,
            };
            stack.push((f, i + 1));
            if let Some(n) = next {
                if seen.insert(key(&n)) {
                    stack.push((n, 0));
                }
            }
        } else {
            post.push(f);
        }
    }
    post.reverse();
    post
}

/// The gradient slots of `n`'s outputs in `grads` (made empty on first use).
fn slots<'a>(
    grads: &'a mut FxHashMap<usize, SmallVec<[Option<Tensor>; 1]>>,
    n: &Arc<Node>,
) -> &'a mut SmallVec<[Option<Tensor>; 1]> {
    grads
        .entry(key(n))
        .or_insert_with(|| SmallVec::from_elem(None, n.outputs.len()))
}

/// Backpropagates from `root` with `seed` (ones when None) and accumulates into the leaves'
/// grad slots. Each node's saved tensors are released as its backward runs, unless `retain`.
pub(crate) fn backward(root: &Tensor, seed: Option<Tensor>, retain: bool) -> Result<()> {
    let seed = match seed {
        Some(s) => {
            same_shape("backward", s.shape(), root.shape(), || {
                format!(
                    "seed gradient {} does not match the tensor {}",
                    s.describe(),
                    root.describe()
                )
            })?;
            s.detach()
        }
        None => ones_like(root)?,
    };
    let _ng = no_grad();
    let Some((root_fn, root_out)) = node_edge(root) else {
        if root.requires_grad() {
            let mut slot = root.grad();
            accumulate(&mut slot, seed)?;
            root.autograd().set_grad(slot);
            return Ok(());
        }
        return Err(TensorError::Autograd {
            op: "backward",
            detail: format!(
                "{} does not require grad and has no autograd history",
                root.describe()
            ),
        });
    };
    let _ctx_guard = root.context().map(Context::install);
    let order = topo_order(&root_fn);
    let hook = hook::current();
    // For each leaf, the position in `order` of the last node with an edge to it: once that
    // node is walked, the leaf's gradient of this pass is final.
    let mut last_use: FxHashMap<usize, usize> = FxHashMap::default();
    let mut finals: Vec<Vec<usize>> = vec![Vec::new(); order.len()];
    for (i, f) in order.iter().enumerate() {
        for edge in f.edges.iter().flatten() {
            if let Edge::Leaf(leaf) = edge {
                last_use.insert(Weak::as_ptr(leaf) as usize, i);
            }
        }
    }
    // In edge order, so every rank hears of its leaves in the same order.
    for (i, f) in order.iter().enumerate() {
        for edge in f.edges.iter().flatten() {
            if let Edge::Leaf(leaf) = edge {
                let k = Weak::as_ptr(leaf) as usize;
                if last_use.get(&k) == Some(&i) && !finals[i].contains(&k) {
                    finals[i].push(k);
                }
            }
        }
    }
    let mut grads: FxHashMap<usize, SmallVec<[Option<Tensor>; 1]>> = FxHashMap::default();
    if let Some(slot) = slots(&mut grads, &root_fn).get_mut(root_out) {
        *slot = Some(seed);
    }
    // Leaves in first-seen order, with their gradients of this pass.
    let mut leaves: Vec<(Weak<TensorImpl>, Option<Tensor>)> = Vec::new();
    let mut leaf_index: FxHashMap<usize, usize> = FxHashMap::default();
    for (i, f) in order.iter().enumerate() {
        walk_node(f, &mut grads, &mut leaves, &mut leaf_index, retain)?;
        for k in &finals[i] {
            if let Some(&idx) = leaf_index.get(k) {
                let (leaf, g) = &mut leaves[idx];
                // A leaf nobody holds has nobody to read its gradient.
                if let (Some(g), Some(leaf)) = (g.take(), leaf.upgrade()) {
                    settle(&Tensor(leaf), g, hook.as_deref())?;
                }
            }
        }
    }
    if let Some(h) = &hook {
        h.finish()?;
    }
    Ok(())
}

/// Accumulates a leaf's final gradient of this pass into its grad slot: boxed to the leaf's
/// `grad_layout` unless the hook takes it, in which case the hook hears it is ready.
fn settle(leaf: &Tensor, g: Tensor, hook: Option<&dyn GradReadyHook>) -> Result<()> {
    let taken = hook.filter(|h| h.takes(leaf));
    let g = match (taken, leaf.autograd().grad_layout(), g.placement()) {
        (None, Some(nd), Some(p)) => g.to_global(p, nd)?,
        _ => g,
    };
    let mut slot = leaf.grad();
    accumulate(&mut slot, g.detach())?;
    leaf.autograd().set_grad(slot);
    match taken {
        Some(h) => h.ready(leaf),
        None => Ok(()),
    }
}

/// Where the gradient of `edge`'s input accumulates in this pass: its producer's output slot,
/// or the leaf's gradient of this pass (registered on first use).
fn slot_of<'a>(
    edge: &Edge,
    grads: &'a mut FxHashMap<usize, SmallVec<[Option<Tensor>; 1]>>,
    leaves: &'a mut Vec<(Weak<TensorImpl>, Option<Tensor>)>,
    leaf_index: &mut FxHashMap<usize, usize>,
) -> Result<&'a mut Option<Tensor>> {
    match edge {
        Edge::Node(n, out) => {
            let name = n.name();
            let outputs = n.outputs.len();
            slots(grads, n)
                .get_mut(*out)
                .ok_or_else(|| TensorError::Autograd {
                    op: "backward",
                    detail: format!("{name} has no output {out} (it has {outputs})"),
                })
        }
        Edge::Leaf(leaf) => {
            let k = Weak::as_ptr(leaf) as usize;
            let idx = *leaf_index.entry(k).or_insert_with(|| {
                leaves.push((leaf.clone(), None));
                leaves.len() - 1
            });
            Ok(&mut leaves[idx].1)
        }
    }
}

/// Whether two edges lead to the same tensor (one producer output, or one leaf).
fn same_target(a: &Edge, b: &Edge) -> bool {
    match (a, b) {
        (Edge::Node(n, i), Edge::Node(m, j)) => Arc::ptr_eq(n, m) && i == j,
        (Edge::Leaf(x), Edge::Leaf(y)) => Weak::ptr_eq(x, y),
        _ => false,
    }
}

/// Runs `f`'s backward on its outputs' gradients and routes each input's gradient to the
/// slot of the node it came from, or to the leaf's gradient of this pass. Each input's
/// gradient so far (from consumers walked before) is offered to the rule, which may add it
/// itself (e.g. as the C operand of its product, `Grad::take_partial`): the slot then holds
/// the rule's gradient as it is; otherwise the two are added. An input whose tensor another
/// input of `f` also is gets no offer.
fn walk_node(
    f: &Arc<Node>,
    grads: &mut FxHashMap<usize, SmallVec<[Option<Tensor>; 1]>>,
    leaves: &mut Vec<(Weak<TensorImpl>, Option<Tensor>)>,
    leaf_index: &mut FxHashMap<usize, usize>,
    retain: bool,
) -> Result<()> {
    let Some(dys) = grads.remove(&key(f)) else {
        return Ok(());
    };
    if dys.iter().all(Option::is_none) {
        return Ok(());
    }
    let mut partials: SmallVec<[RefCell<Option<Tensor>>; 3]> = SmallVec::new();
    for (i, edge) in f.edges.iter().enumerate() {
        let unique = edge.as_ref().filter(|e| {
            f.edges
                .iter()
                .enumerate()
                .all(|(j, o)| j == i || !o.as_ref().is_some_and(|o| same_target(e, o)))
        });
        let partial = match unique {
            Some(e) => slot_of(e, grads, leaves, leaf_index)?.take(),
            None => None,
        };
        partials.push(RefCell::new(partial));
    }
    let offered: SmallVec<[bool; 3]> = partials.iter().map(|p| p.borrow().is_some()).collect();
    let dxs = f.backward(&dys, retain, &partials)?;
    drop(dys);
    for (i, ((edge, input), dx)) in f.edges.iter().zip(&f.inputs).zip(dxs).enumerate() {
        let Some(edge) = edge else {
            continue;
        };
        let offer = offered.get(i).copied().unwrap_or(false);
        let left = partials.get(i).and_then(|p| p.borrow_mut().take());
        let taken = offer && left.is_none();
        let slot = slot_of(edge, grads, leaves, leaf_index)?;
        if offer {
            // The offered partial back in its slot, or the slot empty for the rule's sum.
            *slot = left;
        }
        let Some(dx) = dx else {
            if taken {
                return Err(TensorError::Autograd {
                    op: "backward",
                    detail: format!(
                        "the backward of {} took input {i}'s partial gradient and gave none",
                        f.name()
                    ),
                });
            }
            continue;
        };
        same_shape("backward", dx.shape(), input.shape(), || {
            format!(
                "the backward of {} gave a gradient {} for input {}",
                f.name(),
                dx.describe(),
                input.describe()
            )
        })?;
        accumulate(slot, dx)?;
    }
    Ok(())
}
