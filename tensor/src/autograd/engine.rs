//! The backward pass: topological order of the nodes reachable from the root, one backward
//! rule per node (given one gradient per output), gradient accumulation into the leaves' grad
//! slots. A node's saved tensors are released as its backward runs (their last use).

use std::sync::Arc;

use oxiflow_sbp::NdSbp;
use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use crate::context::Context;
use crate::tensor::Tensor;
use crate::{Result, TensorError};

use super::no_grad;
use super::node::{Edge, Node};

fn key(f: &Arc<Node>) -> usize {
    Arc::as_ptr(f) as usize
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
            if s.shape() != root.shape() {
                return Err(TensorError::Autograd {
                    op: "backward",
                    detail: format!(
                        "seed gradient {} does not match the tensor {}",
                        s.describe(),
                        root.describe()
                    ),
                });
            }
            s.detach()
        }
        None => ones_like(root)?,
    };
    let _ng = no_grad();
    let Some((root_fn, root_out)) = root.autograd().grad_edge() else {
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
    let mut grads: FxHashMap<usize, SmallVec<[Option<Tensor>; 1]>> = FxHashMap::default();
    if let Some(slot) = slots(&mut grads, &root_fn).get_mut(root_out) {
        *slot = Some(seed);
    }
    // Leaves in first-seen order, with their gradients of this pass.
    let mut leaves: Vec<(Tensor, Option<Tensor>)> = Vec::new();
    let mut leaf_index: FxHashMap<usize, usize> = FxHashMap::default();
    for f in &order {
        let Some(dys) = grads.remove(&key(f)) else {
            continue;
        };
        if dys.iter().all(Option::is_none) {
            continue;
        }
        let dxs = f.backward(&dys, retain)?;
        drop(dys);
        for ((edge, input), dx) in f.edges.iter().zip(&f.inputs).zip(dxs) {
            let (Some(edge), Some(dx)) = (edge, dx) else {
                continue;
            };
            if dx.shape() != input.shape() {
                return Err(TensorError::Autograd {
                    op: "backward",
                    detail: format!(
                        "the backward of {} gave a gradient {} for input {}",
                        f.name(),
                        dx.describe(),
                        input.describe()
                    ),
                });
            }
            match edge {
                Edge::Node(n, out) => match slots(&mut grads, n).get_mut(*out) {
                    Some(slot) => accumulate(slot, dx)?,
                    None => {
                        return Err(TensorError::Autograd {
                            op: "backward",
                            detail: format!(
                                "{} has no output {out} (it has {})",
                                n.name(),
                                n.outputs.len()
                            ),
                        })
                    }
                },
                Edge::Leaf(leaf) => {
                    let k = Arc::as_ptr(&leaf.0) as usize;
                    let idx = *leaf_index.entry(k).or_insert_with(|| {
                        leaves.push((leaf.clone(), None));
                        leaves.len() - 1
                    });
                    accumulate(&mut leaves[idx].1, dx)?;
                }
            }
        }
    }
    for (leaf, g) in leaves {
        if let Some(g) = g {
            let g = match (leaf.autograd().grad_layout(), g.placement()) {
                (Some(nd), Some(p)) => g.to_global(p, nd)?,
                _ => g,
            };
            let mut slot = leaf.grad();
            accumulate(&mut slot, g.detach())?;
            leaf.autograd().set_grad(slot);
        }
    }
    Ok(())
}
