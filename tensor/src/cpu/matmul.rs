//! Matrix multiplication CPU kernels, written into the executor's output buffer: a [.., k] x
//! b [k, n] (matrixmultiply through ndarray's `general_mat_mul` into the output view, row blocks
//! on rayon when large) and batch matmul (rayon over batches); transposed operands are strided
//! views, never copies.

use ndarray::linalg::general_mat_mul;
use ndarray::parallel::prelude::*;
use ndarray::{ArrayD, ArrayView2, ArrayView3, ArrayViewMut2, Axis, Ix2, Zip};
use oxiflow_dtype::MatmulPrecision;

use super::{out_as, CpuBackend};
use crate::element::TensorElement;
use crate::op::{kernel_err, BinaryOp, ElementwiseKernels, MatmulKernels};
use crate::storage::CpuArray;
use crate::{Result, TensorError};

/// Work (m * k * n) above which a single matmul is split into row blocks on rayon.
const PAR_WORK: usize = 1 << 21;

fn err(op: &'static str, a: &[usize], b: &[usize], out: &[usize]) -> TensorError {
    kernel_err(
        op,
        format!("local pieces {a:?} and {b:?} do not multiply into {out:?}"),
    )
}

/// out = a b for 2-d views of fitting shapes.
fn mm_into<T: TensorElement>(
    a: ArrayView2<'_, T>,
    b: ArrayView2<'_, T>,
    mut out: ArrayViewMut2<'_, T>,
) {
    let (m, k, n) = (a.nrows(), a.ncols(), b.ncols());
    let (one, zero) = (T::one(), T::from_f64(0.0));
    if m * k * n >= PAR_WORK && m >= 2 {
        let threads = rayon::current_num_threads().max(1);
        let rows = m.div_ceil(threads * 2).max(1);
        out.axis_chunks_iter_mut(Axis(0), rows)
            .into_par_iter()
            .zip(a.axis_chunks_iter(Axis(0), rows).into_par_iter())
            .for_each(|(mut o, a)| general_mat_mul(one, &a, &b, zero, &mut o));
    } else {
        general_mat_mul(one, &a, &b, zero, &mut out);
    }
}

/// `op(a) [.., m, k] @ op(b) [k, n]` into out `[.., m, n]`: every leading dim of `a` folds into
/// m (a transposed `a` is 2-d).
fn product<T: TensorElement>(
    op: &'static str,
    a: &ArrayD<T>,
    b: &ArrayD<T>,
    (ta, tb): (bool, bool),
    out: &mut ArrayD<T>,
) -> Result<()> {
    let out_shape = out.shape().to_vec();
    let bad = || err(op, a.shape(), b.shape(), &out_shape);
    let b2 = b.view().into_dimensionality::<Ix2>().map_err(|_| bad())?;
    let b2 = if tb { b2.reversed_axes() } else { b2 };
    let a2 = if ta {
        a.view()
            .into_dimensionality::<Ix2>()
            .map_err(|_| bad())?
            .reversed_axes()
    } else {
        let k = *a.shape().last().ok_or_else(bad)?;
        let m: usize = a.shape()[..a.ndim() - 1].iter().product();
        a.view().into_shape_with_order((m, k)).map_err(|_| bad())?
    };
    let (m, n) = (a2.nrows(), b2.ncols());
    if b2.nrows() != a2.ncols() || out.len() != m * n {
        return Err(bad());
    }
    let o = out
        .view_mut()
        .into_shape_with_order((m, n))
        .map_err(|_| bad())?;
    mm_into(a2, b2, o);
    Ok(())
}

/// `a [b.., m, k]` viewed as `[batch, m, k]`, its last two dims swapped when `t`.
fn batches<'a, T>(x: &'a ArrayD<T>, t: bool) -> Option<ArrayView3<'a, T>> {
    let nd = x.ndim();
    if nd < 3 {
        return None;
    }
    let (r, c) = (x.shape()[nd - 2], x.shape()[nd - 1]);
    let batch: usize = x.shape()[..nd - 2].iter().product();
    let v = x.view().into_shape_with_order((batch, r, c)).ok()?;
    Some(if t { v.permuted_axes([0, 2, 1]) } else { v })
}

/// `op(a) [b.., m, k] @ op(b) [b.., k, n]` into out `[b.., m, n]`.
fn batch_product<T: TensorElement>(
    op: &'static str,
    a: &ArrayD<T>,
    b: &ArrayD<T>,
    (ta, tb): (bool, bool),
    out: &mut ArrayD<T>,
) -> Result<()> {
    let out_shape = out.shape().to_vec();
    let bad = || err(op, a.shape(), b.shape(), &out_shape);
    let nd = a.ndim();
    if b.ndim() != nd || a.shape()[..nd.saturating_sub(2)] != b.shape()[..nd.saturating_sub(2)] {
        return Err(bad());
    }
    let (a3, b3) = (
        batches(a, ta).ok_or_else(bad)?,
        batches(b, tb).ok_or_else(bad)?,
    );
    let (batch, m, k, n) = (
        a3.len_of(Axis(0)),
        a3.len_of(Axis(1)),
        a3.len_of(Axis(2)),
        b3.len_of(Axis(2)),
    );
    if b3.len_of(Axis(1)) != k || out.len() != batch * m * n {
        return Err(bad());
    }
    let mut o3 = out
        .view_mut()
        .into_shape_with_order((batch, m, n))
        .map_err(|_| bad())?;
    let (one, zero) = (T::one(), T::from_f64(0.0));
    let z = Zip::from(o3.outer_iter_mut())
        .and(a3.outer_iter())
        .and(b3.outer_iter());
    let f = |mut o: ArrayViewMut2<T>, x: ArrayView2<T>, y: ArrayView2<T>| {
        general_mat_mul(one, &x, &y, zero, &mut o)
    };
    if batch > 1 && batch * m * k * n >= PAR_WORK / 8 {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
    Ok(())
}

/// The typed product of `a` and `b` into `out` (all three of one dtype).
fn typed(
    op: &'static str,
    a: &CpuArray,
    b: &CpuArray,
    t: (bool, bool),
    batched: bool,
    out: &mut CpuArray,
) -> Result<()> {
    fn run<T: TensorElement>(
        op: &'static str,
        a: &ArrayD<T>,
        b: &ArrayD<T>,
        t: (bool, bool),
        batched: bool,
        out: &mut ArrayD<T>,
    ) -> Result<()> {
        if batched {
            batch_product(op, a, b, t, out)
        } else {
            product(op, a, b, t, out)
        }
    }
    match (a, b) {
        (CpuArray::F32(x), CpuArray::F32(y)) => run(op, x, y, t, batched, out_as(op, out)?),
        (CpuArray::F64(x), CpuArray::F64(y)) => run(op, x, y, t, batched, out_as(op, out)?),
        (CpuArray::I64(x), CpuArray::I64(y)) => run(op, x, y, t, batched, out_as(op, out)?),
        _ => Err(err(op, a.shape(), b.shape(), out.shape())),
    }
}

impl MatmulKernels for CpuBackend {
    // The precision is a device notion: f32 products run in f32 here whatever it says.
    fn matmul(
        &self,
        a: &CpuArray,
        b: &CpuArray,
        _precision: MatmulPrecision,
        out: &mut CpuArray,
    ) -> Result<()> {
        typed("matmul", a, b, (false, false), false, out)
    }
    fn batch_matmul(
        &self,
        a: &CpuArray,
        b: &CpuArray,
        _precision: MatmulPrecision,
        out: &mut CpuArray,
    ) -> Result<()> {
        typed("batch_matmul", a, b, (false, false), true, out)
    }
    fn matmul_t(
        &self,
        a: &CpuArray,
        b: &CpuArray,
        t: (bool, bool),
        batched: bool,
        _precision: MatmulPrecision,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = if batched {
            "batch_matmul_t"
        } else {
            "matmul_t"
        };
        typed(op, a, b, t, batched, out)
    }
    fn matmul_t_acc(
        &self,
        a: &CpuArray,
        b: &CpuArray,
        t: (bool, bool),
        batched: bool,
        c: &CpuArray,
        _precision: MatmulPrecision,
        out: &mut CpuArray,
    ) -> Result<()> {
        let op = "matmul_t_acc";
        typed(op, a, b, t, batched, out)?;
        let product = out.clone();
        self.binary(BinaryOp::Add, &product, c, out)
    }
}
