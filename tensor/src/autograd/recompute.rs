//! Activation recomputation: [`recompute`] runs a block forward and keeps only its inputs for
//! the backward pass, which runs the block again with grad mode on and backpropagates through
//! that second graph. The activations inside the block are freed after the forward; the price is
//! the block's forward computed twice. Random ops inside the block must be counter-based with
//! explicit seeds (as `dropout` is), so the second run equals the first.

use std::fmt;
use std::sync::Arc;

use crate::op::Grad;
use crate::tensor::Tensor;
use crate::Result;

use super::node::{attach, NodeKind, Rerun};
use super::{engine, is_grad_enabled, set_grad_enabled};

/// A block's forward: a function of its inputs.
type BlockFn = dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync;

/// The block a recompute node runs again.
struct Block(Box<BlockFn>);

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("recompute block")
    }
}

/// `f(inputs)`, recorded so that the backward pass recomputes it instead of keeping its
/// intermediate tensors. Parameters the block reads (captured by `f`) get their gradients when
/// the block's backward runs, as if the block had been run without recomputation. `f` must be
/// deterministic (same ops, same seeds); every rank must call it the same way.
pub fn recompute<F>(inputs: &[&Tensor], f: F) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    if !is_grad_enabled() {
        return f(&owned);
    }
    // Forward with grad mode on, on detached inputs, so the block's graph (and with it every
    // intermediate tensor) is dropped when this function returns; whether the output requires
    // a gradient says whether anything inside (an input or a captured parameter) does.
    let detached: Vec<Tensor> = owned
        .iter()
        .map(|t| t.detach().requires_grad_(t.requires_grad()))
        .collect();
    let out = f(&detached)?;
    if !out.requires_grad() {
        return Ok(out);
    }
    let result = out.detach();
    let outputs = [result];
    attach(
        NodeKind::Recompute(Arc::new(Block(Box::new(f)))),
        inputs,
        &outputs,
        true,
    );
    let [result] = outputs;
    Ok(result)
}

impl Rerun for Block {
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        rerun(self, g)
    }
}

/// Backward of a recompute node: runs the block again on detached copies of its (saved)
/// inputs with grad mode on, then backpropagates `dy` through that graph. Captured parameters
/// accumulate their gradients there; the inputs' gradients are returned.
fn rerun(block: &Block, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
    let dy = g.dy()?;
    let _grad = set_grad_enabled(true);
    let mut leaves: Vec<Tensor> = Vec::with_capacity(g.arity());
    for i in 0..g.arity() {
        leaves.push(g.input(i)?.detach().requires_grad_(g.need(i)));
    }
    let out = (block.0)(&leaves)?;
    engine::same_shape("recompute", out.shape(), dy.shape(), || {
        format!(
            "the recomputed block gave {} but its first run gave a gradient of {}",
            out.describe(),
            dy.describe()
        )
    })?;
    if out.requires_grad() {
        engine::backward(&out, Some(dy.clone()), false)?;
    }
    Ok(leaves
        .iter()
        .enumerate()
        .map(|(i, l)| if g.need(i) { l.grad() } else { None })
        .collect())
}
