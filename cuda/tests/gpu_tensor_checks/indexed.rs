//! The GPU suite's op cases of the indexed, masking and vocabulary-parallel ops: min, gather,
//! index_select, where, masked_fill, triu/tril, rotary; cross-entropy of class-split logits
//! and an embedding with a vocabulary-split weight, with their gradients.

use super::super::*;
use super::op_cases::{Make, OpCase};

/// Integer ids in `0..n` of `shape` (sigmoid of a randn input, scaled, truncated).
fn ids_in(mk: &Make, shape: &[usize], seed: u64, s: usize, n: usize) -> Result<Tensor> {
    mk(shape, seed, s)?
        .sigmoid()?
        .mul_scalar(n as f64 - 0.01)?
        .cast(DType::I64)
}

/// Op kind 12: the element-wise and indexed ops; kind 13: vocabulary parallelism.
pub(crate) fn run_indexed_case(c: &OpCase, mk: &Make) -> Result<Vec<Tensor>> {
    let s = c.seed * 10;
    let x = || mk(&[c.r, c.c], s, c.sa);
    if c.kind == 12 {
        let a = x()?;
        let d = (c.v % 2) as isize;
        let idx = ids_in(mk, &[c.r, 3], s + 1, c.sb % 3, c.c)?;
        let ids = ids_in(mk, &[c.k], s + 2, c.sb % 2 * 2, c.c)?;
        let mask = mk(&[c.c], s + 3, 2)?.relu()?;
        let kd = c.v as i64 % 3 - 1;
        let rot = mk(&[c.r, 2, 2 * c.k], s + 4, c.sa % 2)?;
        return Ok(vec![
            a.min(&[d], c.v >= 4)?,
            a.gather(1, &idx)?,
            a.index_select(1, &ids)?,
            Tensor::where_cond(&mask, &a, &a.neg()?)?,
            a.masked_fill(&mask, -1.0)?,
            a.triu(kd)?,
            a.tril(kd)?,
            rot.rotary(0, 10000.0)?,
        ]);
    }
    let logits = mk(&[c.r, c.c], s, 1)?.requires_grad_(true);
    let lab = ids_in(mk, &[c.r], s + 1, 2, c.c)?;
    let loss = logits.cross_entropy(&lab)?.mean_all()?;
    loss.backward()?;
    let table = mk(&[c.c, c.k], s + 2, 0)?.requires_grad_(true);
    let emb = Tensor::embedding(&lab, &table)?;
    emb.square()?.mean_all()?.backward()?;
    let grads = [&logits, &table].into_iter().filter_map(|t| t.grad());
    let mut out = vec![loss, emb];
    out.extend(grads);
    Ok(out)
}
