//! Element traits of tensor storage: `TensorElement` (f32, f64, i64) and `FloatElement` (f32, f64).

use ndarray::{ArrayD, LinalgScalar, ScalarOperand};
use oxiflow_collectives::Element;

use crate::storage::CpuArray;

/// A scalar type a tensor can hold: f32, f64 or i64.
pub trait TensorElement:
    Element + LinalgScalar + ScalarOperand + std::ops::Neg<Output = Self>
{
    /// Wraps an owned array as CPU storage.
    fn wrap(a: ArrayD<Self>) -> CpuArray;
    /// Borrows the array when the storage holds this type.
    fn view(s: &CpuArray) -> Option<&ArrayD<Self>>;
    /// Borrows the array mutably when the storage holds this type.
    fn view_mut(s: &mut CpuArray) -> Option<&mut ArrayD<Self>>;
    /// Takes the array out when the storage holds this type.
    fn unwrap(s: CpuArray) -> Option<ArrayD<Self>>;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    /// Largest representable value's negation (identity of max).
    fn lowest() -> Self;
    /// Largest representable value (identity of min).
    fn highest() -> Self;
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

macro_rules! float_elem {
    ($t:ty, $variant:ident) => {
        impl TensorElement for $t {
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
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn lowest() -> Self {
                <$t>::NEG_INFINITY
            }
            fn highest() -> Self {
                <$t>::INFINITY
            }
        }
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
float_elem!(f32, F32);
float_elem!(f64, F64);

impl TensorElement for i64 {
    fn wrap(a: ArrayD<Self>) -> CpuArray {
        CpuArray::I64(a)
    }
    fn view(s: &CpuArray) -> Option<&ArrayD<Self>> {
        match s {
            CpuArray::I64(a) => Some(a),
            _ => None,
        }
    }
    fn view_mut(s: &mut CpuArray) -> Option<&mut ArrayD<Self>> {
        match s {
            CpuArray::I64(a) => Some(a),
            _ => None,
        }
    }
    fn unwrap(s: CpuArray) -> Option<ArrayD<Self>> {
        match s {
            CpuArray::I64(a) => Some(a),
            _ => None,
        }
    }
    fn from_f64(v: f64) -> Self {
        v as i64
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn lowest() -> Self {
        i64::MIN
    }
    fn highest() -> Self {
        i64::MAX
    }
}
