//! Element traits of tensor storage: `TensorElement` (every dtype of the table: f32, f64, i64,
//! bf16, f16) and `FloatElement` (f32, f64: the types CPU kernels compute floats in; 16-bit
//! pieces reach the kernels as f32, see `cpu::execute`).

use ndarray::{ArrayD, LinalgScalar};
use oxiflow_dtype::{bf16, f16, Element};

use crate::storage::CpuArray;

/// A scalar type a tensor can hold.
pub trait TensorElement: Element + LinalgScalar + std::ops::Neg<Output = Self> {
    /// Wraps an owned array as CPU storage.
    fn wrap(a: ArrayD<Self>) -> CpuArray;
    /// Borrows the array when the storage holds this type.
    fn view(s: &CpuArray) -> Option<&ArrayD<Self>>;
    /// Borrows the array mutably when the storage holds this type.
    fn view_mut(s: &mut CpuArray) -> Option<&mut ArrayD<Self>>;
    /// Takes the array out when the storage holds this type.
    fn unwrap(s: CpuArray) -> Option<ArrayD<Self>>;
    /// Largest representable value's negation (identity of max).
    fn lowest() -> Self {
        Self::LOWEST
    }
    /// Largest representable value (identity of min).
    fn highest() -> Self {
        Self::HIGHEST
    }
}

/// Floating point element types, with the math the kernels need.
pub trait FloatElement: TensorElement + std::ops::AddAssign + std::ops::MulAssign {
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn sqrt(self) -> Self;
    fn recip(self) -> Self;
    fn abs(self) -> Self;
    fn powf(self, e: Self) -> Self;
}

/// `TensorElement` for each (type, `CpuArray` variant) pair.
macro_rules! tensor_elements {
    ($($t:ty => $variant:ident),* $(,)?) => {
        $(impl TensorElement for $t {
            fn wrap(a: ArrayD<Self>) -> CpuArray {
                CpuArray::$variant(a)
            }
            fn view(s: &CpuArray) -> Option<&ArrayD<Self>> {
                match s {
                    CpuArray::$variant(a) => Some(a),
                    _ => None,
                }
            }
            fn view_mut(s: &mut CpuArray) -> Option<&mut ArrayD<Self>> {
                match s {
                    CpuArray::$variant(a) => Some(a),
                    _ => None,
                }
            }
            fn unwrap(s: CpuArray) -> Option<ArrayD<Self>> {
                match s {
                    CpuArray::$variant(a) => Some(a),
                    _ => None,
                }
            }
        })*
    };
}
tensor_elements!(f32 => F32, f64 => F64, i64 => I64, bf16 => BF16, f16 => F16);

macro_rules! float_elem {
    ($t:ty) => {
        impl FloatElement for $t {
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn recip(self) -> Self {
                <$t>::recip(self)
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
        }
    };
}
float_elem!(f32);
float_elem!(f64);
