//! The `Tensor` methods of the elementwise family (`op/elementwise.rs`): they build its ops
//! and dispatch them.

use oxiflow_dtype::DType;

use crate::dispatch::dispatch;
use crate::op::{BinaryOp, ElementwiseOp, F64Bits, ScalarOp, UnaryOp};
use crate::tensor::Tensor;
use crate::Result;

fn elementwise(op: ElementwiseOp, inputs: &[&Tensor]) -> Result<Tensor> {
    dispatch(op.into(), inputs)
}

macro_rules! unary_methods {
    ($($name:ident => $u:ident),* $(,)?) => {
        $(
            #[doc = concat!("Element-wise `", stringify!($name), "`.")]
            pub fn $name(&self) -> Result<Tensor> {
                self.unary(UnaryOp::$u)
            }
        )*
    };
}

impl Tensor {
    unary_methods!(neg => Neg, relu => Relu, gelu => Gelu, exp => Exp, log => Log, tanh => Tanh,
        sigmoid => Sigmoid, sqrt => Sqrt, abs => Abs, square => Square);

    /// Any element-wise unary function.
    pub fn unary(&self, u: UnaryOp) -> Result<Tensor> {
        elementwise(ElementwiseOp::Unary(u), &[self])
    }
    fn scalar_op(&self, s: ScalarOp, c: f64) -> Result<Tensor> {
        elementwise(ElementwiseOp::Scalar(s, F64Bits::new(c)), &[self])
    }
    /// x * c (linear: keeps a partial-sum SBP).
    pub fn scale(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Mul, c)
    }
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Mul, c)
    }
    pub fn div_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Mul, 1.0 / c)
    }
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Add, c)
    }
    pub fn sub_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Add, -c)
    }
    /// c - x
    pub fn rsub_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::RSub, c)
    }
    /// c / x
    pub fn rdiv_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::RDiv, c)
    }
    /// x ^ c
    pub fn pow_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Pow, c)
    }

    /// Broadcasting add.
    pub fn add(&self, o: &Tensor) -> Result<Tensor> {
        elementwise(ElementwiseOp::Binary(BinaryOp::Add), &[self, o])
    }
    pub fn sub(&self, o: &Tensor) -> Result<Tensor> {
        elementwise(ElementwiseOp::Binary(BinaryOp::Sub), &[self, o])
    }
    pub fn mul(&self, o: &Tensor) -> Result<Tensor> {
        elementwise(ElementwiseOp::Binary(BinaryOp::Mul), &[self, o])
    }
    pub fn div(&self, o: &Tensor) -> Result<Tensor> {
        elementwise(ElementwiseOp::Binary(BinaryOp::Div), &[self, o])
    }
    /// Converts the element type, each value rounded once to nearest (float -> i64 truncates
    /// toward zero); differentiable: the gradient is converted back to the input's dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        elementwise(ElementwiseOp::Cast(dtype), &[self])
    }
    /// [`Tensor::to_dtype`] of each rank's piece as it is: a partial sum stays a partial sum
    /// whose parts are each rounded once (its value may differ from the rounded sum by the
    /// parts' roundings), where `to_dtype` of a partial sum that may round reduces it first.
    /// For a gradient computed in f32 and kept in a 16-bit dtype, so it reaches its data-parallel
    /// reduction unreduced. Differentiable as `to_dtype`.
    pub fn to_dtype_parts(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        elementwise(ElementwiseOp::CastParts(dtype), &[self])
    }
    /// [`Tensor::to_dtype`].
    pub fn cast(&self, dtype: DType) -> Result<Tensor> {
        self.to_dtype(dtype)
    }
    /// dx = dy * f'(x) for y = f(x) (`self` is dy), from what the forward saves: `saved` is
    /// y for exp, tanh and sigmoid (`UnaryOp::saves_output`), x for the others.
    pub fn unary_backward(&self, u: UnaryOp, saved: &Tensor) -> Result<Tensor> {
        elementwise(ElementwiseOp::UnaryBackward(u), &[self, saved])
    }
}
