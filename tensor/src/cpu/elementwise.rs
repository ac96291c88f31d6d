//! Element-wise CPU kernels, written into the executor's output buffer: unary functions, scalar
//! forms, broadcasting binary ops, casts and the element-wise backward kernels; contiguous slices
//! in a plain loop, rayon for large arrays.

use ndarray::{ArrayD, IxDyn, Zip};
use rayon::prelude::*;

use super::elementwise_fns::{
    with_binary_fn, with_scalar_fn, with_unary_backward_fn, with_unary_fn,
};
use super::{fits, float_input, out_as, CpuBackend, PAR_THRESHOLD};
use crate::element::{FloatElement, TensorElement};
use crate::op::{kernel_err, BinaryOp, ElementwiseKernels, ScalarOp, UnaryOp};
use crate::storage::CpuArray;
use crate::{with_array, Result};

/// `out[i] = f(a[i])` for arrays of one shape.
fn map_into<T: TensorElement, U: TensorElement>(
    a: &ArrayD<T>,
    out: &mut ArrayD<U>,
    f: impl Fn(T) -> U + Sync + Send,
) {
    let big = a.len() >= PAR_THRESHOLD;
    if let (Some(x), Some(y)) = (a.as_slice(), out.as_slice_mut()) {
        if big {
            y.par_iter_mut()
                .zip(x.par_iter())
                .for_each(|(o, &v)| *o = f(v));
        } else {
            y.iter_mut().zip(x).for_each(|(o, &v)| *o = f(v));
        }
        return;
    }
    let z = Zip::from(out).and(a);
    if big {
        z.par_for_each(|o, &v| *o = f(v));
    } else {
        z.for_each(|o, &v| *o = f(v));
    }
}

/// `out = f(a, b)` with `a` and `b` broadcast to `out`'s shape; None when they do not.
fn zip2_into<T: TensorElement>(
    a: &ArrayD<T>,
    b: &ArrayD<T>,
    out: &mut ArrayD<T>,
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Option<()> {
    let big = out.len() >= PAR_THRESHOLD;
    if a.shape() == out.shape() && b.shape() == out.shape() {
        // Contiguous operands of one shape: a plain loop over the slices (no n-d iteration).
        if let (Some(x), Some(y), Some(o)) = (a.as_slice(), b.as_slice(), out.as_slice_mut()) {
            if big {
                o.par_iter_mut()
                    .zip(x.par_iter().zip(y.par_iter()))
                    .for_each(|(o, (&p, &q))| *o = f(p, q));
            } else {
                o.iter_mut()
                    .zip(x.iter().zip(y))
                    .for_each(|(o, (&p, &q))| *o = f(p, q));
            }
            return Some(());
        }
    }
    let dim = IxDyn(out.shape());
    let (av, bv) = (a.broadcast(dim.clone())?, b.broadcast(dim)?);
    let z = Zip::from(out).and(&av).and(&bv);
    if big {
        z.par_for_each(|o, &x, &y| *o = f(x, y));
    } else {
        z.for_each(|o, &x, &y| *o = f(x, y));
    }
    Some(())
}

fn float_unary<F: FloatElement>(u: UnaryOp, a: &ArrayD<F>, out: &mut ArrayD<F>) {
    with_unary_fn!(u, F, f => map_into(a, out, f))
}

/// y = f(x).
fn unary(u: UnaryOp, a: &CpuArray, out: &mut CpuArray) -> Result<()> {
    let op = u.name();
    fits(op, a.shape(), out.shape())?;
    match a {
        CpuArray::F32(a) => float_unary(u, a, out_as(op, out)?),
        CpuArray::F64(a) => float_unary(u, a, out_as(op, out)?),
        a @ (CpuArray::BF16(_) | CpuArray::F16(_)) => return Err(float_input(op, a)),
        CpuArray::I64(a) => {
            let o = out_as::<i64>(op, out)?;
            match u {
                UnaryOp::Neg => map_into(a, o, |x| x.wrapping_neg()),
                UnaryOp::Abs => map_into(a, o, |x| x.wrapping_abs()),
                UnaryOp::Square => map_into(a, o, |x| x.wrapping_mul(x)),
                UnaryOp::Relu => map_into(a, o, |x| x.max(0)),
                _ => return Err(kernel_err(op, "needs a float input, got i64".into())),
            }
        }
    }
    Ok(())
}

fn float_unary_backward<F: FloatElement>(
    u: UnaryOp,
    dy: &ArrayD<F>,
    x: &ArrayD<F>,
    out: &mut ArrayD<F>,
) -> Option<()> {
    with_unary_backward_fn!(u, F, f => zip2_into(dy, x, out, f))
}

/// dx = dy * f'(x), from the forward input x, or for exp, tanh and sigmoid the output y.
fn unary_backward(u: UnaryOp, dy: &CpuArray, x: &CpuArray, out: &mut CpuArray) -> Result<()> {
    let op = u.backward_name();
    let shapes_ok = dy.shape() == x.shape() && dy.shape() == out.shape();
    let done = match (dy, x) {
        (CpuArray::F32(g), CpuArray::F32(x)) if shapes_ok => {
            float_unary_backward(u, g, x, out_as(op, out)?)
        }
        (CpuArray::F64(g), CpuArray::F64(x)) if shapes_ok => {
            float_unary_backward(u, g, x, out_as(op, out)?)
        }
        _ => None,
    };
    done.ok_or_else(|| {
        kernel_err(
            op,
            format!(
                "needs float dy and x of one shape, got {:?} and {:?}",
                dy.shape(),
                x.shape()
            ),
        )
    })
}

fn float_scalar<F: FloatElement>(s: ScalarOp, a: &ArrayD<F>, c: f64, out: &mut ArrayD<F>) {
    let c = F::from_f64(c);
    with_scalar_fn!(s, F, f => map_into(a, out, move |x| f(x, c)))
}

/// y = x (op) c.
fn scalar(s: ScalarOp, a: &CpuArray, c: f64, out: &mut CpuArray) -> Result<()> {
    let op = s.name();
    fits(op, a.shape(), out.shape())?;
    match a {
        CpuArray::F32(a) => float_scalar(s, a, c, out_as(op, out)?),
        CpuArray::F64(a) => float_scalar(s, a, c, out_as(op, out)?),
        a @ (CpuArray::BF16(_) | CpuArray::F16(_)) => return Err(float_input(op, a)),
        CpuArray::I64(a) => {
            let (ci, o) = (c as i64, out_as::<i64>(op, out)?);
            match s {
                ScalarOp::Add => map_into(a, o, move |x| x.wrapping_add(ci)),
                ScalarOp::Mul => map_into(a, o, move |x| x.wrapping_mul(ci)),
                ScalarOp::RSub => map_into(a, o, move |x| ci.wrapping_sub(x)),
                ScalarOp::RDiv | ScalarOp::Pow => {
                    return Err(kernel_err(op, "needs a float input, got i64".into()))
                }
            }
        }
    }
    Ok(())
}

fn typed_binary<T: TensorElement>(
    b: BinaryOp,
    x: &ArrayD<T>,
    y: &ArrayD<T>,
    out: &mut ArrayD<T>,
) -> Option<()> {
    with_binary_fn!(b, T, f => zip2_into(x, y, out, f))
}

/// Broadcasting z = x (op) y.
fn binary(b: BinaryOp, x: &CpuArray, y: &CpuArray, out: &mut CpuArray) -> Result<()> {
    let done = match (x, y, &mut *out) {
        (CpuArray::F32(p), CpuArray::F32(q), CpuArray::F32(o)) => typed_binary(b, p, q, o),
        (CpuArray::F64(p), CpuArray::F64(q), CpuArray::F64(o)) => typed_binary(b, p, q, o),
        (CpuArray::I64(p), CpuArray::I64(q), CpuArray::I64(o))
            if b != BinaryOp::Div || q.iter().all(|&v| v != 0) =>
        {
            typed_binary(b, p, q, o)
        }
        _ => None,
    };
    done.ok_or_else(|| {
        kernel_err(
            b.name(),
            format!(
                "local pieces {:?} ({}) and {:?} ({}) do not fit the output {:?} ({}) (or an \
                 integer division by zero)",
                x.shape(),
                x.dtype(),
                y.shape(),
                y.dtype(),
                out.shape(),
                out.dtype()
            ),
        )
    })
}

/// Every element converted to the output's dtype, each value rounded once (float -> i64
/// truncates toward zero); the same dtype is a copy.
pub(super) fn cast_into(x: &CpuArray, out: &mut CpuArray) -> Result<()> {
    fn to<T: TensorElement, U: TensorElement>(a: &ArrayD<T>, o: &mut ArrayD<U>) {
        map_into(a, o, |v| U::from_f64(v.to_f64()))
    }
    fits("cast", x.shape(), out.shape())?;
    with_array!(out, o => with_array!(x, a => to(a, o)));
    Ok(())
}

impl ElementwiseKernels for CpuBackend {
    fn unary(&self, u: UnaryOp, x: &CpuArray, out: &mut CpuArray) -> Result<()> {
        unary(u, x, out)
    }
    fn scalar(&self, s: ScalarOp, c: f64, x: &CpuArray, out: &mut CpuArray) -> Result<()> {
        scalar(s, x, c, out)
    }
    fn binary(&self, b: BinaryOp, x: &CpuArray, y: &CpuArray, out: &mut CpuArray) -> Result<()> {
        binary(b, x, y, out)
    }
    fn cast(&self, x: &CpuArray, out: &mut CpuArray) -> Result<()> {
        cast_into(x, out)
    }
    fn unary_backward(
        &self,
        u: UnaryOp,
        dy: &CpuArray,
        x: &CpuArray,
        out: &mut CpuArray,
    ) -> Result<()> {
        unary_backward(u, dy, x, out)
    }
}
