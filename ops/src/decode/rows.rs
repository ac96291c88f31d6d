//! `WriteRows`: n caches with rows written along one dim from a given position (inputs: the
//! caches, then their rows; outputs: the caches with `rows[i]` at `at..at + t` of `dim`, the
//! rest as it was). Caches split on that dim (a sequence split over ranks) take whole rows:
//! each rank writes those that fall in its part. [`write_rows_in_place`] writes them in the caches' own memory where
//! nothing else holds it (a decoding loop's cache, one launch per step), else makes new
//! caches and puts them in place of the old ones.

use std::sync::LazyLock;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, NdSbp, RuleMode, Sbp, Shape};
use oxiflow_tensor::{
    dispatch_into, dispatch_multi, Extern, ExternOp, Inferred, Kernels, LocalAt, MetaError,
    MetaResult, Result, Tensor, TensorError,
};

use super::op_types::WriteRows;
use super::{cpu, cuda, DTYPES};
use crate::op_signature::{kernels_without_gradient, op_signature};
use crate::operand_dtypes::kernels_for;

/// The `caches` with `rows[i]` written at `at..` along `dim` of `caches[i]` (new tensors).
pub fn write_rows(
    caches: &[&Tensor],
    rows: &[&Tensor],
    dim: usize,
    at: usize,
) -> Result<Vec<Tensor>> {
    let inputs = operands(caches, rows)?;
    dispatch_multi(
        Extern::new(WriteRows {
            dim,
            at,
            window: None,
        })
        .into(),
        &inputs,
    )
}

/// [`write_rows`] into `caches` themselves: in their own memory where nothing but these
/// handles holds it (see `oxiflow_tensor::dispatch_into`), else by putting the new caches in
/// their place; returns whether it wrote in place. Every rank calls it alike.
pub fn write_rows_in_place(
    caches: &mut [Tensor],
    rows: &[&Tensor],
    dim: usize,
    at: usize,
) -> Result<bool> {
    let op = Extern::new(WriteRows {
        dim,
        at,
        window: None,
    });
    let cs: Vec<&Tensor> = caches.iter().collect();
    operands(&cs, rows)?;
    // Rows laid out as their caches (a relabel where the layouts differ only in name), so
    // the write needs no boxing and gives each cache its own layout.
    let moved = rows
        .iter()
        .zip(&cs)
        .map(|(r, c)| rows_beside(r, c, dim))
        .collect::<Result<Vec<_>>>()?;
    let moved: Vec<&Tensor> = moved.iter().collect();
    let inputs = operands(&cs, &moved)?;
    if dispatch_into(op.clone().into(), &inputs, &cs)? {
        return Ok(true);
    }
    let new = dispatch_multi(op.into(), &inputs)?;
    drop(cs);
    for (c, n) in caches.iter_mut().zip(new) {
        *c = n;
    }
    Ok(false)
}

/// `rows` laid out for a write into `cache` along `dim`: as the cache, but whole on the mesh
/// axes that split the cache on `dim` (each rank then writes the rows in its part).
pub fn rows_beside(rows: &Tensor, cache: &Tensor, dim: usize) -> Result<Tensor> {
    match (cache.placement(), cache.nd_sbp()) {
        (Some(p), Some(nd)) if nd.iter().any(|s| s == Sbp::S(dim)) => {
            let whole = NdSbp::new(
                nd.iter()
                    .map(|s| if s == Sbp::S(dim) { Sbp::B } else { s })
                    .collect::<Vec<_>>(),
            );
            rows.to_global(p, whole)
        }
        _ => rows.to_layout_of(cache),
    }
}

/// The op's inputs: the caches, then their rows.
fn operands<'a>(caches: &[&'a Tensor], rows: &[&'a Tensor]) -> Result<Vec<&'a Tensor>> {
    if caches.is_empty() || caches.len() != rows.len() {
        return Err(TensorError::Shape {
            op: "write_rows",
            shapes: format!("{} caches, {} row blocks", caches.len(), rows.len()),
            sbps: String::new(),
            detail: "needs one row block per cache, and at least one".into(),
        });
    }
    Ok(caches.iter().chain(rows).copied().collect())
}

static KERNELS: LazyLock<Kernels> =
    LazyLock::new(|| kernels_for::<WriteRows>(DTYPES, cpu::write_rows, cuda::write_rows));

impl ExternOp for WriteRows {
    op_signature!("write_rows", 2..=usize::MAX);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend((self.dim as u64).to_le_bytes());
        key.extend((self.at as u64).to_le_bytes());
        if let Some((first, count)) = self.window {
            key.extend((first as u64).to_le_bytes());
            key.extend((count as u64).to_le_bytes());
        }
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let n = shapes.len() / 2;
        let r = rules::write_rows(self.dim, shapes, mode).map_err(MetaError::Shape)?;
        for i in 0..n {
            let (c, rows) = (shapes[i], shapes[n + i]);
            if dtypes[i] != dtypes[n + i] {
                return Err(MetaError::DType(format!(
                    "cache {i} is {} but its rows are {}",
                    dtypes[i],
                    dtypes[n + i]
                )));
            }
            if self.at + rows.dim(self.dim) > c.dim(self.dim) {
                return Err(MetaError::Shape(format!(
                    "rows {rows} from position {} overrun cache {c} along dim {}",
                    self.at, self.dim
                )));
            }
        }
        Ok(Inferred {
            rules: r,
            dtypes: dtypes[..n].to_vec().into(),
        })
    }
    fn local(&self, at: &LocalAt<'_>) -> Option<Extern> {
        // Caches split on `dim` (one length, so one region): this rank writes the rows that
        // fall in its part, from its part's start.
        let n = at.global_inputs.len() / 2;
        let part = at.input_regions.first()?.get(self.dim)?.clone();
        let (len, t) = (
            at.global_inputs.first()?.dims().get(self.dim).copied()?,
            at.global_inputs.get(n)?.dims().get(self.dim).copied()?,
        );
        if part == (0..len) {
            return None;
        }
        let (lo, hi) = (self.at.max(part.start), (self.at + t).min(part.end));
        let count = hi.saturating_sub(lo);
        Some(Extern::new(WriteRows {
            dim: self.dim,
            at: if count > 0 { lo - part.start } else { 0 },
            window: Some((if count > 0 { lo - self.at } else { 0 }, count)),
        }))
    }
    kernels_without_gradient!(KERNELS, "a cache write has no gradient");
}
