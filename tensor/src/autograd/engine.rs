//! The backward pass: topological order of the nodes reachable from the root, one backward
//! rule per node, gradient accumulation into the leaves' grad slots.

use std::sync::Arc;

use oxiflow_sbp::NdSbp;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::context::Context;
use crate::tensor::Tensor;
use crate::{Result, TensorError};

use super::no_grad;
use super::node::Node;

fn node_of(t: &Tensor) -> Option<Arc<Node>> {
    t.autograd().grad_fn()
}

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
fn topo_order(root: &Arc<Node>) -> Result<Vec<Arc<Node>>> {
    let mut post: Vec<Arc<Node>> = Vec::new();
    let mut seen: FxHashSet<usize> = FxHashSet::default();
    // (node, next input index to visit)
    let mut stack: Vec<(Arc<Node>, usize)> = vec![(root.clone(), 0)];
    seen.insert(key(root));
    while let Some((f, i)) = stack.pop() {
        let node = &f;
        if i < node.inputs.len() {
            let next = if node.needs[i] {
                node_of(&node.inputs[i])
            } else {
                None
            };
            stack.push((f.clone(), i + 1));
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
    Ok(post)
}

pub(crate) fn backward(root: &Tensor, seed: Option<Tensor>) -> Result<()> {
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
    let Some(root_fn) = node_of(root) else {
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
    let order = topo_order(&root_fn)?;
    let mut grads: FxHashMap<usize, Option<Tensor>> = FxHashMap::default();
    grads.insert(key(&root_fn), Some(seed));
    // Leaves in first-seen order, with their gradients of this pass.
    let mut leaves: Vec<(Tensor, Option<Tensor>)> = Vec::new();
    let mut leaf_index: FxHashMap<usize, usize> = FxHashMap::default();
    for f in &order {
        let Some(dy) = grads.remove(&key(f)).flatten() else {
            continue;
        };
        let node = f;
        let dxs = node.backward(&dy)?;
        for ((input, need), dx) in node.inputs.iter().zip(&node.needs).zip(dxs) {
            let (true, Some(dx)) = (*need, dx) else {
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
            match node_of(input) {
                Some(n) => accumulate(grads.entry(key(&n)).or_insert(None), dx)?,
                None => {
                    let k = Arc::as_ptr(&input.0) as usize;
                    let idx = *leaf_index.entry(k).or_insert_with(|| {
                        leaves.push((input.clone(), None));
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
