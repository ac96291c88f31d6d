//! Element-wise CUDA kernels, written into the executor's output piece: unary, scalar and
//! broadcasting binary functions, casts, and the unary functions' backward. Same-shape f32,
//! bf16 and f16 adds and products, products with a scalar f32 holds exactly, GELU and its
//! backward run on the raw layer's 16-byte vectorised kernel.

use super::super::copy::cast;
use super::super::derr;
use super::super::fused::{elementwise, Elementwise, EwOp};
use super::super::kernels::{grid, launch, strides, Nd, Template};
use super::super::raw::FloatType;
use super::super::storage::CudaStorage;
use super::{fits, float_only, CudaKernels};
use oxiflow_dtype::DType;
use oxiflow_tensor::backend::ElementwiseKernels;
use oxiflow_tensor::Result;
use oxiflow_tensor::{BinaryOp, ScalarOp, UnaryOp};

pub(crate) fn unary_code(u: UnaryOp) -> i32 {
    match u {
        UnaryOp::Neg => 0,
        UnaryOp::Relu => 1,
        UnaryOp::Gelu => 2,
        UnaryOp::Exp => 3,
        UnaryOp::Log => 4,
        UnaryOp::Tanh => 5,
        UnaryOp::Sigmoid => 6,
        UnaryOp::Sqrt => 7,
        UnaryOp::Abs => 8,
        UnaryOp::Square => 9,
    }
}

impl CudaKernels {
    /// `out = op(a[, b][, c])` on the vectorised kernel when every piece has `out`'s shape and
    /// dtype, one the kernel takes; false (nothing run) otherwise.
    fn vectorised(
        &self,
        op: EwOp,
        a: &CudaStorage,
        b: Option<&CudaStorage>,
        c: f32,
        out: &CudaStorage,
    ) -> Result<bool> {
        let Some(dtype) = FloatType::of(out.dtype) else {
            return Ok(false);
        };
        let fits = |p: &CudaStorage| p.dtype == out.dtype && p.shape == out.shape;
        if !fits(a) || !b.is_none_or(fits) {
            return Ok(false);
        }
        let e = Elementwise {
            op,
            dtype,
            n: out.numel(),
            a: a.ptr(),
            b: b.map_or(0, CudaStorage::ptr),
            c,
            y: out.ptr(),
        };
        elementwise(&self.rt, &e)?;
        Ok(true)
    }
}

impl ElementwiseKernels for CudaKernels {
    fn unary(&self, u: UnaryOp, a: &CudaStorage, out: &mut CudaStorage) -> Result<()> {
        if u == UnaryOp::Gelu && self.vectorised(EwOp::Gelu, a, None, 0.0, out)? {
            return Ok(());
        }
        let (rt, name) = (&self.rt, u.name());
        let (dt, n) = (a.dtype, a.numel());
        fits(name, a, out, true)?;
        let y = &*out;
        let (nn, code, xp, yp) = (n as i64, unary_code(u), a.ptr(), y.ptr());
        if dt == DType::I64 {
            if !u.takes_integers() {
                return Err(derr(name, "needs a float input, got i64"));
            }
            if n > 0 {
                launch!(rt, name, Template::Unary.at(DType::I64), grid(n); nn, code, xp, yp)?;
            }
        } else if n > 0 {
            launch!(rt, name, Template::Unary.at(dt), grid(n); nn, code, xp, yp)?;
        }
        Ok(())
    }

    fn scalar(&self, s: ScalarOp, c: f64, a: &CudaStorage, out: &mut CudaStorage) -> Result<()> {
        // The vectorised kernel scales in f32: only by a factor f32 holds exactly.
        let exact = c as f32 as f64 == c;
        if s == ScalarOp::Mul && exact && self.vectorised(EwOp::Scale, a, None, c as f32, out)? {
            return Ok(());
        }
        let (rt, name) = (&self.rt, s.name());
        let code: i32 = match s {
            ScalarOp::Add => 0,
            ScalarOp::Mul => 1,
            ScalarOp::RSub => 2,
            ScalarOp::RDiv => 3,
            ScalarOp::Pow => 4,
        };
        let (dt, n) = (a.dtype, a.numel());
        if dt == DType::I64 && !s.takes_integers() {
            return Err(derr(name, "needs a float input, got i64"));
        }
        fits(name, a, out, true)?;
        let y = &*out;
        let (nn, cv, xp, yp) = (n as i64, c, a.ptr(), y.ptr());
        if n > 0 {
            launch!(rt, name, Template::Scalar.at(dt), grid(n); nn, code, cv, xp, yp)?;
        }
        Ok(())
    }

    fn binary(
        &self,
        b: BinaryOp,
        a: &CudaStorage,
        x1: &CudaStorage,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let ew = match b {
            BinaryOp::Add => Some(EwOp::Add),
            BinaryOp::Mul => Some(EwOp::Mul),
            BinaryOp::Sub | BinaryOp::Div => None,
        };
        if let Some(op) = ew {
            if self.vectorised(op, a, Some(x1), 0.0, out)? {
                return Ok(());
            }
        }
        let (rt, name) = (&self.rt, b.name());
        let dt = a.dtype;
        if dt == DType::I64 && b == BinaryOp::Div {
            return Err(derr(name, "integer division is not supported on cuda"));
        }
        if x1.dtype != dt {
            return Err(derr(name, format!("dtypes {} and {}", dt, x1.dtype)));
        }
        let od = out.shape.dims();
        if a.shape.ndim() > od.len() || x1.shape.ndim() > od.len() {
            return Err(derr(
                name,
                format!(
                    "{} and {} do not broadcast to {}",
                    a.shape, x1.shape, out.shape
                ),
            ));
        }
        let bstr = |s: &CudaStorage| -> Vec<i64> {
            let sd = s.shape.dims();
            let st = strides(sd);
            let lead = od.len() - sd.len();
            (0..od.len())
                .map(|i| {
                    if i < lead || sd[i - lead] == 1 {
                        0
                    } else {
                        st[i - lead]
                    }
                })
                .collect()
        };
        let (sa, sb) = (bstr(a), bstr(x1));
        let p = Nd::new(od, &sa, &sb).ok_or_else(|| derr(name, "more than 8 broadcast dims"))?;
        let y = &*out;
        let code: i32 = match b {
            BinaryOp::Add => 0,
            BinaryOp::Sub => 1,
            BinaryOp::Mul => 2,
            BinaryOp::Div => 3,
        };
        let m = y.numel();
        let (nn, ap, bp, yp) = (m as i64, a.ptr(), x1.ptr(), y.ptr());
        if m > 0 {
            launch!(rt, name, Template::Binary.at(dt), grid(m); nn, code, p, ap, bp, yp)?;
        }
        Ok(())
    }

    fn cast(&self, a: &CudaStorage, out: &mut CudaStorage) -> Result<()> {
        let (rt, name) = (&self.rt, "cast");
        let (dt, n, to) = (a.dtype, a.numel(), out.dtype);
        fits(name, a, out, false)?;
        if to == dt {
            return super::layout::copy_into(&self.rt, name, a, out);
        }
        cast(rt, name, (dt, a.ptr()), (to, out.ptr()), n)
    }

    fn unary_backward(
        &self,
        u: UnaryOp,
        dy: &CudaStorage,
        x: &CudaStorage,
        out: &mut CudaStorage,
    ) -> Result<()> {
        if u == UnaryOp::Gelu && self.vectorised(EwOp::GeluBackward, dy, Some(x), 0.0, out)? {
            return Ok(());
        }
        let (rt, name) = (&self.rt, u.backward_name());
        let (dt, n) = (dy.dtype, dy.numel());
        float_only(name, dt)?;
        fits(name, dy, out, true)?;
        fits(name, x, out, true)?;
        let y = &*out;
        let (nn, code, gp, xp, yp) = (n as i64, unary_code(u), dy.ptr(), x.ptr(), y.ptr());
        if n > 0 {
            launch!(rt, name, Template::UnaryBw.at(dt), grid(n); nn, code, gp, xp, yp)?;
        }
        Ok(())
    }
}
