//! Embedding CPU kernels: row lookup and its backward (scatter-add of dy rows into the weight).

use ndarray::{Array2, ArrayD, IxDyn};

use super::{check_ids, checked, rows, CpuBackend};
use crate::element::FloatElement;
use crate::op::kernel_err;
use crate::op::{EmbeddingKernels, OutSpec};
use crate::storage::CpuArray;
use crate::Result;

fn embedding_t<F: FloatElement>(w: &ArrayD<F>, ids: &ArrayD<i64>) -> Result<ArrayD<F>> {
    let w2 = rows(w).ok_or_else(|| kernel_err("embedding", "weight must be 2-d".into()))?;
    check_ids("embedding", ids, w2.nrows())?;
    let h = w2.ncols();
    let mut out = Array2::<F>::zeros((ids.len(), h));
    for (mut row, &i) in out.outer_iter_mut().zip(ids.iter()) {
        row.assign(&w2.row(i as usize));
    }
    let mut shape = ids.shape().to_vec();
    shape.push(h);
    out.into_shape_with_order(IxDyn(&shape))
        .map_err(|e| kernel_err("embedding", e.to_string()))
}

/// weight [V, H] gathered at ids [..] -> [.., H].
pub fn embedding(w: &CpuArray, ids: &CpuArray) -> Result<CpuArray> {
    match (w, ids) {
        (CpuArray::F32(w), CpuArray::I64(i)) => Ok(CpuArray::F32(embedding_t(w, i)?)),
        (CpuArray::F64(w), CpuArray::I64(i)) => Ok(CpuArray::F64(embedding_t(w, i)?)),
        _ => Err(kernel_err(
            "embedding",
            "needs a float weight and i64 ids".into(),
        )),
    }
}

fn embedding_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    ids: &ArrayD<i64>,
    num: usize,
) -> Result<ArrayD<F>> {
    let g = rows(dy)
        .ok_or_else(|| kernel_err("embedding_backward", "dy must have a hidden dim".into()))?;
    check_ids("embedding_backward", ids, num)?;
    let mut out = Array2::<F>::zeros((num, g.ncols()));
    for (row, &i) in g.outer_iter().zip(ids.iter()) {
        let mut o = out.row_mut(i as usize);
        o += &row;
    }
    Ok(out.into_dyn())
}

/// Scatter-add of dy [.., H] rows into dweight [num, H] at ids [..].
pub fn embedding_backward(dy: &CpuArray, ids: &CpuArray, num: usize) -> Result<CpuArray> {
    match (dy, ids) {
        (CpuArray::F32(g), CpuArray::I64(i)) => Ok(CpuArray::F32(embedding_backward_t(g, i, num)?)),
        (CpuArray::F64(g), CpuArray::I64(i)) => Ok(CpuArray::F64(embedding_backward_t(g, i, num)?)),
        _ => Err(kernel_err(
            "embedding_backward",
            "needs float dy and i64 ids".into(),
        )),
    }
}

impl EmbeddingKernels for CpuBackend {
    fn embedding(&self, ids: &CpuArray, weight: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked("embedding", embedding(weight, ids)?, out)
    }
    fn embedding_backward(
        &self,
        ids: &CpuArray,
        dy: &CpuArray,
        num: usize,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        checked("embedding_backward", embedding_backward(dy, ids, num)?, out)
    }
}
