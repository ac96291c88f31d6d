//! Host arrays and their element traits: `CpuArray` (one variant per dtype of the table) and
//! the traits of its elements: `TensorElement` (every dtype of the table: f32, f64, i64,
//! bf16, f16) and `FloatElement` (f32, f64: the types CPU kernels compute floats in; 16-bit
//! pieces reach the kernels as f32, see `cpu::execute`).

use ndarray::{ArrayD, IxDyn, LinalgScalar};
use oxiflow_dtype::{bf16, f16, with_element, DType, Element};

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

/// `FloatElement` for each float type, every method its inherent namesake.
macro_rules! float_elem {
    ($($t:ty),*) => {
        $(float_elem!(@one $t; exp, ln, tanh, sqrt, recip, abs);)*
    };
    (@one $t:ty; $($unary:ident),*) => {
        impl FloatElement for $t {
            $(fn $unary(self) -> Self {
                <$t>::$unary(self)
            })*
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
        }
    };
}
float_elem!(f32, f64);

/// A host array of one of the dtypes. Always standard (row-major contiguous) layout.
#[derive(Clone, Debug)]
pub enum CpuArray {
    F32(ArrayD<f32>),
    F64(ArrayD<f64>),
    I64(ArrayD<i64>),
    BF16(ArrayD<bf16>),
    F16(ArrayD<f16>),
}

/// Applies `$body` to the array inside a `CpuArray`, binding it as `$a` (generic over the type).
#[macro_export]
#[doc(hidden)]
macro_rules! with_array {
    ($s:expr, $a:ident => $body:expr) => {
        match $s {
            $crate::CpuArray::F32($a) => $body,
            $crate::CpuArray::F64($a) => $body,
            $crate::CpuArray::I64($a) => $body,
            $crate::CpuArray::BF16($a) => $body,
            $crate::CpuArray::F16($a) => $body,
        }
    };
}

impl CpuArray {
    pub fn dtype(&self) -> DType {
        with_array!(self, a => elem_dtype(a))
    }
    pub fn shape(&self) -> &[usize] {
        with_array!(self, a => a.shape())
    }
    /// An array of zeros.
    pub fn zeros(dtype: DType, shape: &[usize]) -> CpuArray {
        with_element!(dtype, T => T::wrap(ArrayD::<T>::zeros(IxDyn(shape))))
    }
    /// Makes the layout standard (row-major contiguous), copying only when needed.
    pub fn into_standard(self) -> CpuArray {
        fn std<T: TensorElement>(a: ArrayD<T>) -> CpuArray {
            T::wrap(if a.is_standard_layout() {
                a
            } else {
                a.as_standard_layout().into_owned()
            })
        }
        with_array!(self, a => std(a))
    }
    /// The array of type `T`, or None for another dtype.
    pub fn as_array<T: TensorElement>(&self) -> Option<&ArrayD<T>> {
        T::view(self)
    }
    /// Converts every element to `dtype`, each value rounded once (float -> i64 truncates
    /// toward zero); the same dtype is a copy.
    pub fn cast(&self, dtype: DType) -> CpuArray {
        fn conv<S: TensorElement, T: TensorElement>(a: &ArrayD<S>) -> CpuArray {
            T::wrap(a.mapv(|v| T::from_f64(v.to_f64())))
        }
        if dtype == self.dtype() {
            return self.clone();
        }
        with_array!(self, a => with_element!(dtype, T => conv::<_, T>(a)))
    }
}

fn elem_dtype<T: TensorElement>(_: &ArrayD<T>) -> DType {
    T::DTYPE
}
