//! Mask CPU kernels, written into the executor's output buffer: where, masked fill (conditions of any dtype, nonzero is true) and the
//! triangular masks over a piece at a global row/column offset.

use ndarray::{ArrayD, IxDyn, Zip};

use super::{fits, float_input, out_as, CpuBackend};
use crate::element::TensorElement;
use crate::op::{kernel_err, MaskKernels, Triangle};
use crate::storage::CpuArray;
use crate::{with_array, Result};

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
    out: &mut ArrayD<T>,
) -> Result<()> {
    let (to, shape) = (IxDyn(out.shape()), out.shape().to_vec());
    let cv = c
        .broadcast(to.clone())
        .ok_or_else(|| broadcast_err("where", c.shape(), &shape))?;
    let av = a
        .broadcast(to.clone())
        .ok_or_else(|| broadcast_err("where", a.shape(), &shape))?;
    let bv = b
        .broadcast(to)
        .ok_or_else(|| broadcast_err("where", b.shape(), &shape))?;
    Zip::from(out)
        .and(&cv)
        .and(&av)
        .and(&bv)
        .for_each(|o, &c, &a, &b| *o = if c { a } else { b });
    Ok(())
}

fn masked_fill_t<T: TensorElement>(
    x: &ArrayD<T>,
    m: &ArrayD<bool>,
    v: T,
    out: &mut ArrayD<T>,
) -> Result<()> {
    fits("masked_fill", x.shape(), out.shape())?;
    let mv = m
        .broadcast(x.raw_dim())
        .ok_or_else(|| broadcast_err("masked_fill", m.shape(), x.shape()))?;
    Zip::from(out)
        .and(x)
        .and(&mv)
        .for_each(|o, &x, &m| *o = if m { v } else { x });
    Ok(())
}

fn triangular_t<T: TensorElement>(
    x: &ArrayD<T>,
    (keep, k): (Triangle, i64),
    (row0, col0): (usize, usize),
    out: &mut ArrayD<T>,
) -> Result<()> {
    fits("triangular", x.shape(), out.shape())?;
    let nd = x.ndim();
    let x = x.as_standard_layout();
    for ((idx, o), &v) in out.indexed_iter_mut().zip(x.iter()) {
        // Global column minus global row, exact in i128 for any sizes and any k.
        let diag = (col0 as i128 + idx[nd - 1] as i128) - (row0 as i128 + idx[nd - 2] as i128);
        let kept = match keep {
            Triangle::Upper => diag >= k as i128,
            Triangle::Lower => diag <= k as i128,
        };
        *o = if kept { v } else { T::from_f64(0.0) };
    }
    Ok(())
}

impl MaskKernels for CpuBackend {
    fn where_cond(
        &self,
        cond: &CpuArray,
        a: &CpuArray,
        b: &CpuArray,
        out: &mut CpuArray,
    ) -> Result<()> {
        let (op, c) = ("where", nonzero(cond));
        match (a, b) {
            (CpuArray::F32(a), CpuArray::F32(b)) => where_t(&c, a, b, out_as(op, out)?),
            (CpuArray::F64(a), CpuArray::F64(b)) => where_t(&c, a, b, out_as(op, out)?),
            (CpuArray::I64(a), CpuArray::I64(b)) => where_t(&c, a, b, out_as(op, out)?),
            _ => Err(kernel_err(op, "values of different dtypes".into())),
        }
    }
    fn masked_fill(
        &self,
        x: &CpuArray,
        mask: &CpuArray,
        value: f64,
        out: &mut CpuArray,
    ) -> Result<()> {
        let (op, m) = ("masked_fill", nonzero(mask));
        match x {
            CpuArray::F32(x) => masked_fill_t(x, &m, value as f32, out_as(op, out)?),
            CpuArray::F64(x) => masked_fill_t(x, &m, value, out_as(op, out)?),
            CpuArray::I64(x) => masked_fill_t(x, &m, value as i64, out_as(op, out)?),
            x => Err(float_input(op, x)),
        }
    }
    fn triangular(
        &self,
        x: &CpuArray,
        keep: Triangle,
        k: i64,
        row0: usize,
        col0: usize,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "triangular";
        if x.shape().len() < 2 {
            return Err(kernel_err(op, "needs at least 2 dims".into()));
        }
        with_array!(x, a => triangular_t(a, (keep, k), (row0, col0), out_as(op, out)?))
    }
}
