//! Mask CPU kernels: where, masked fill (conditions of any dtype, nonzero is true) and the
//! triangular masks over a piece at a global row/column offset.

use ndarray::{ArrayD, IxDyn, Zip};

use super::float_input;
use super::{checked, CpuBackend};
use crate::element::TensorElement;
use crate::op::{kernel_err, MaskKernels, OutSpec, Triangle};
use crate::storage::CpuArray;
use crate::with_array;
use crate::Result;

/// Whether each element is nonzero.
fn nonzero(a: &CpuArray) -> ArrayD<bool> {
    with_array!(a, a => a.mapv(|v| oxiflow_dtype::Element::to_f64(v) != 0.0))
}

fn broadcast_err(op: &'static str, from: &[usize], to: &[usize]) -> crate::TensorError {
    kernel_err(op, format!("{from:?} does not broadcast to {to:?}"))
}

fn where_t<T: TensorElement>(
    c: &ArrayD<bool>,
    a: &ArrayD<T>,
    b: &ArrayD<T>,
    shape: &[usize],
) -> Result<ArrayD<T>> {
    let to = IxDyn(shape);
    let cv = c
        .broadcast(to.clone())
        .ok_or_else(|| broadcast_err("where", c.shape(), shape))?;
    let av = a
        .broadcast(to.clone())
        .ok_or_else(|| broadcast_err("where", a.shape(), shape))?;
    let bv = b
        .broadcast(to.clone())
        .ok_or_else(|| broadcast_err("where", b.shape(), shape))?;
    Ok(Zip::from(&cv)
        .and(&av)
        .and(&bv)
        .map_collect(|&c, &a, &b| if c { a } else { b }))
}

fn masked_fill_t<T: TensorElement>(x: &ArrayD<T>, m: &ArrayD<bool>, v: T) -> Result<ArrayD<T>> {
    let mv = m
        .broadcast(x.raw_dim())
        .ok_or_else(|| broadcast_err("masked_fill", m.shape(), x.shape()))?;
    Ok(Zip::from(x)
        .and(&mv)
        .map_collect(|&x, &m| if m { v } else { x }))
}

fn triangular_t<T: TensorElement>(
    x: &ArrayD<T>,
    keep: Triangle,
    k: i64,
    row0: usize,
    col0: usize,
) -> ArrayD<T> {
    let nd = x.ndim();
    let mut out = x.to_owned();
    for (idx, v) in out.indexed_iter_mut() {
        // Global column minus global row, exact in i128 for any sizes and any k.
        let diag = (col0 as i128 + idx[nd - 1] as i128) - (row0 as i128 + idx[nd - 2] as i128);
        let kept = match keep {
            Triangle::Upper => diag >= k as i128,
            Triangle::Lower => diag <= k as i128,
        };
        if !kept {
            *v = T::from_f64(0.0);
        }
    }
    out
}

impl MaskKernels for CpuBackend {
    fn where_cond(
        &self,
        cond: &CpuArray,
        a: &CpuArray,
        b: &CpuArray,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        let (c, s) = (nonzero(cond), out.shape.dims());
        let y = match (a, b) {
            (CpuArray::F32(a), CpuArray::F32(b)) => CpuArray::F32(where_t(&c, a, b, s)?),
            (CpuArray::F64(a), CpuArray::F64(b)) => CpuArray::F64(where_t(&c, a, b, s)?),
            (CpuArray::I64(a), CpuArray::I64(b)) => CpuArray::I64(where_t(&c, a, b, s)?),
            _ => return Err(kernel_err("where", "values of different dtypes".into())),
        };
        checked("where", y, out)
    }
    fn masked_fill(
        &self,
        x: &CpuArray,
        mask: &CpuArray,
        value: f64,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        let m = nonzero(mask);
        let y = match x {
            CpuArray::F32(x) => CpuArray::F32(masked_fill_t(x, &m, value as f32)?),
            CpuArray::F64(x) => CpuArray::F64(masked_fill_t(x, &m, value)?),
            CpuArray::I64(x) => CpuArray::I64(masked_fill_t(x, &m, value as i64)?),
            x => return Err(float_input("masked_fill", x)),
        };
        checked("masked_fill", y, out)
    }
    fn triangular(
        &self,
        x: &CpuArray,
        keep: Triangle,
        k: i64,
        row0: usize,
        col0: usize,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        if x.shape().len() < 2 {
            return Err(kernel_err("triu", "needs at least 2 dims".into()));
        }
        let y = match x {
            CpuArray::F32(x) => CpuArray::F32(triangular_t(x, keep, k, row0, col0)),
            CpuArray::F64(x) => CpuArray::F64(triangular_t(x, keep, k, row0, col0)),
            CpuArray::I64(x) => CpuArray::I64(triangular_t(x, keep, k, row0, col0)),
            x => return Err(float_input("triangular", x)),
        };
        checked("triangular", y, out)
    }
}
