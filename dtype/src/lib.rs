//! The one table of element types, at the bottom of the dependency graph: [`DType`] and every
//! fact about a dtype (byte size, names, float or 16-bit float, the safetensors name), the
//! [`Element`] trait of the Rust scalars that have a dtype (f32, f64, i64, `half::bf16`,
//! `half::f16`), and [`Half`], the 16-bit floats with their f32 conversions of raw bytes
//! (reductions and CPU kernels compute 16-bit data in f32 and round once); and the one
//! precision policy, [`MixedPrecision`] with its [`MatmulPrecision`].
//!
//! ```
//! use oxiflow_dtype::DType;
//! let d: DType = "bf16".parse().unwrap();
//! assert_eq!((d.size(), d.is_half(), d.safetensors_name()), (2, true, "BF16"));
//! ```

use std::fmt;

pub use half::{bf16, f16};

/// `Display` as the enum's `as_str()`, and `FromStr` finding in its `ALL` the value of that
/// name in any case (any other name: `$err { name }`).
macro_rules! named_by_as_str {
    ($t:ident, $err:ident) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $t {
            type Err = $err;
            fn from_str(s: &str) -> Result<$t, $err> {
                $t::ALL
                    .into_iter()
                    .find(|v| v.as_str().eq_ignore_ascii_case(s))
                    .ok_or_else(|| $err { name: s.into() })
            }
        }
    };
}

mod precision;
pub use precision::{MatmulPrecision, MixedPrecision, PrecisionError, UnknownMatmulPrecision};

/// Element type of a buffer or tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum DType {
    F32,
    F64,
    I64,
    /// bfloat16: f32's exponent range with 8 significant bits.
    BF16,
    /// IEEE 754 binary16.
    F16,
}

/// A 16-bit float dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Half {
    BF16,
    F16,
}

/// A dtype name that is not in the table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {name:?} (known: f32, f64, i64, bf16, f16)")]
pub struct UnknownDType {
    pub name: String,
}

impl DType {
    /// Every dtype.
    pub const ALL: [DType; 5] = [DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }
    /// The name errors, logs, manifests and command lines use (`"bf16"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
    /// The dtype's name in a safetensors header (`"BF16"`).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
        }
    }
    /// The dtype of a safetensors header name, if the table has it.
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.safetensors_name() == name)
    }
    /// A small number naming the dtype on the wire (its index in [`DType::ALL`]).
    pub const fn code(self) -> u8 {
        self as u8
    }
    /// The dtype of a [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code)).copied()
    }
    /// Floating point (f32, f64, bf16, f16).
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::I64)
    }
    /// A 16-bit float (bf16, f16).
    pub const fn is_half(self) -> bool {
        self.half().is_some()
    }
    /// The 16-bit float this dtype is, if it is one.
    pub const fn half(self) -> Option<Half> {
        match self {
            DType::BF16 => Some(Half::BF16),
            DType::F16 => Some(Half::F16),
            _ => None,
        }
    }
    /// Whether every value of `from` is exactly a value of this dtype, so converting from
    /// `from` never rounds (bf16 and f16 into f32 and f64, f32 into f64, any dtype into
    /// itself). Such a conversion commutes with sums: converting each partial sum converts
    /// their sum.
    pub const fn holds_every(self, from: DType) -> bool {
        from as u8 == self as u8
            || matches!(
                (from, self),
                (DType::BF16 | DType::F16, DType::F32 | DType::F64) | (DType::F32, DType::F64)
            )
    }
    /// The dtype 16-bit floats compute and accumulate in (f32); every other dtype is its own.
    pub const fn compute(self) -> DType {
        if self.is_half() {
            DType::F32
        } else {
            self
        }
    }
}

// Parsed in any case, so the safetensors names parse too.
named_by_as_str!(DType, UnknownDType);

impl Half {
    pub const fn dtype(self) -> DType {
        match self {
            Half::BF16 => DType::BF16,
            Half::F16 => DType::F16,
        }
    }

    /// `dst[i] = src element i` as f32 (exact), `src` holding `dst.len()` 16-bit values as
    /// native-endian bytes (any alignment).
    pub fn widen(self, src: &[u8], dst: &mut [f32]) {
        match self {
            Half::BF16 => widen_as::<bf16>(src, dst, bf16::from_bits, bf16::to_f32),
            Half::F16 => widen_as::<f16>(src, dst, f16::from_bits, f16::to_f32),
        }
    }

    /// `dst` element i = `src[i]` rounded to nearest (ties to even), as native-endian bytes
    /// (any alignment; `dst` holds `src.len()` 16-bit values).
    pub fn narrow(self, src: &[f32], dst: &mut [u8]) {
        match self {
            Half::BF16 => narrow_as::<bf16>(src, dst, bf16::from_f32, bf16::to_bits),
            Half::F16 => narrow_as::<f16>(src, dst, f16::from_f32, f16::to_bits),
        }
    }

    /// The bytes of `src` (16-bit values) as a vector of f32.
    pub fn widened(self, src: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; src.len() / 2];
        self.widen(src, &mut out);
        out
    }
}

fn widen_as<H: bytemuck::Pod>(
    src: &[u8],
    dst: &mut [f32],
    from_bits: fn(u16) -> H,
    to_f32: fn(H) -> f32,
) {
    match bytemuck::try_cast_slice::<u8, H>(src) {
        Ok(s) => dst.iter_mut().zip(s).for_each(|(d, &h)| *d = to_f32(h)),
        Err(_) => dst
            .iter_mut()
            .zip(src.chunks_exact(2))
            .for_each(|(d, c)| *d = to_f32(from_bits(u16::from_ne_bytes([c[0], c[1]])))),
    }
}

fn narrow_as<H: bytemuck::Pod>(
    src: &[f32],
    dst: &mut [u8],
    from_f32: fn(f32) -> H,
    to_bits: fn(H) -> u16,
) {
    match bytemuck::try_cast_slice_mut::<u8, H>(dst) {
        Ok(d) => d.iter_mut().zip(src).for_each(|(d, &v)| *d = from_f32(v)),
        Err(_) => dst
            .chunks_exact_mut(2)
            .zip(src)
            .for_each(|(d, &v)| d.copy_from_slice(&to_bits(from_f32(v)).to_ne_bytes())),
    }
}

/// A Rust scalar type that has a `DType`.
pub trait Element: bytemuck::Pod + Copy + Send + Sync + PartialOrd + fmt::Debug + 'static {
    const DTYPE: DType;
    /// The identity of max: the lowest value (-inf for floats).
    const LOWEST: Self;
    /// The identity of min: the highest value (+inf for floats).
    const HIGHEST: Self;
    fn zero() -> Self;
    /// `self + o` (16-bit floats: in f32, rounded once; i64 wraps).
    fn add(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self {
        if o > self {
            o
        } else {
            self
        }
    }
    fn min(self, o: Self) -> Self {
        if o < self {
            o
        } else {
            self
        }
    }
    /// The value as f64 (exact but for i64 beyond 2^53).
    fn to_f64(self) -> f64;
    /// `v` rounded once to nearest (ties to even); i64 truncates toward zero, saturating.
    fn from_f64(v: f64) -> Self;
}

/// `v` as an f32 rounded to odd: the nearest f32 toward zero, with the last bit set when
/// inexact. Rounding that once more to a float of at most 22 significant bits gives `v`
/// rounded once to that float.
fn f32_round_to_odd(v: f64) -> f32 {
    let r = v as f32;
    if !r.is_finite() || f64::from(r) == v {
        return r;
    }
    // `r` is `v` rounded to nearest; step back toward zero when it rounded away from zero.
    let toward_zero = if f64::from(r).abs() > v.abs() {
        f32::from_bits(r.to_bits() - 1)
    } else {
        r
    };
    f32::from_bits(toward_zero.to_bits() | 1)
}

/// Applies `$body` with `$t` the Rust element type of `$dtype` (the one map from dtypes to
/// Rust types): `with_element!(dtype, T => size_of::<T>())`.
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::BF16 => {
                type $t = $crate::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $t = $crate::f16;
                $body
            }
        }
    };
}

/// `src` converted element by element (each value rounded once, see [`Element::from_f64`]).
pub fn convert<S: Element, D: Element>(src: &[S]) -> Vec<D> {
    src.iter().map(|&v| D::from_f64(v.to_f64())).collect()
}

/// `Element` for a float type `$t` of dtype `$d`: the infinities as the identities of max and
/// min, `+` as `add`; `$to` converts a value `$x` to f64, `$from` a value `$v` from f64.
macro_rules! float_element {
    ($t:ident, $d:ident, $zero:expr, |$x:ident| $to:expr, |$v:ident| $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            const LOWEST: $t = $t::NEG_INFINITY;
            const HIGHEST: $t = $t::INFINITY;
            fn zero() -> Self {
                $zero
            }
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn to_f64(self) -> f64 {
                let $x = self;
                $to
            }
            fn from_f64($v: f64) -> Self {
                $from
            }
        }
    };
}
float_element!(f32, F32, 0.0, |x| f64::from(x), |v| v as f32);
float_element!(f64, F64, 0.0, |x| x, |v| v);
float_element!(bf16, BF16, bf16::ZERO, |x| x.to_f64(), |v| bf16::from_f32(
    f32_round_to_odd(v)
));
float_element!(f16, F16, f16::ZERO, |x| x.to_f64(), |v| f16::from_f32(
    f32_round_to_odd(v)
));

impl Element for i64 {
    const DTYPE: DType = DType::I64;
    const LOWEST: i64 = i64::MIN;
    const HIGHEST: i64 = i64::MAX;
    fn zero() -> Self {
        0
    }
    fn add(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_round_trip_and_sizes_match_the_rust_types() {
        for d in DType::ALL {
            assert_eq!(d.as_str().parse::<DType>(), Ok(d));
            assert_eq!(DType::from_safetensors_name(d.safetensors_name()), Some(d));
            assert_eq!(d.to_string(), d.as_str());
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::F32.size(), std::mem::size_of::<f32>());
        assert_eq!(DType::F64.size(), std::mem::size_of::<f64>());
        assert_eq!(DType::I64.size(), std::mem::size_of::<i64>());
        assert_eq!(DType::BF16.size(), std::mem::size_of::<bf16>());
        assert_eq!(DType::F16.size(), std::mem::size_of::<f16>());
        assert!("float32".parse::<DType>().is_err());
        assert_eq!("BF16".parse::<DType>(), Ok(DType::BF16));
        assert_eq!(DType::from_safetensors_name("U8"), None);
        let floats: Vec<DType> = DType::ALL.into_iter().filter(|d| d.is_float()).collect();
        assert_eq!(floats, [DType::F32, DType::F64, DType::BF16, DType::F16]);
        let halves: Vec<DType> = DType::ALL.into_iter().filter(|d| d.is_half()).collect();
        assert_eq!(halves, [DType::BF16, DType::F16]);
        assert_eq!(DType::BF16.compute(), DType::F32);
        assert_eq!(DType::F64.compute(), DType::F64);
        assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
        assert_eq!(<f16 as Element>::DTYPE, DType::F16);
    }

    #[test]
    fn element_types_follow_the_table() {
        for d in DType::ALL {
            assert_eq!(
                with_element!(d, T => (T::DTYPE, std::mem::size_of::<T>())),
                (d, d.size())
            );
        }
    }

    /// `v` rounded to bf16 by its exact neighbours (the reference for `from_f64`).
    fn bf16_nearest(v: f64) -> bf16 {
        let lo = bf16::from_f32(v as f32);
        let cands = [
            bf16::from_bits(lo.to_bits().wrapping_sub(1)),
            lo,
            bf16::from_bits(lo.to_bits().wrapping_add(1)),
        ];
        let mut best = cands[1];
        for c in cands {
            let (dc, db) = ((c.to_f64() - v).abs(), (best.to_f64() - v).abs());
            if dc < db || (dc == db && c.to_bits() & 1 == 0) {
                best = c;
            }
        }
        best
    }

    proptest! {
        /// f64 -> 16-bit rounds once: ties broken by bits below f32's precision go the right way.
        #[test]
        fn from_f64_rounds_once(m in 0u32..127, low in 1u64..(1 << 29), neg in any::<bool>()) {
            // Half an ulp above a bf16 value, plus less than f32 can hold: rounds up.
            let base = 256.0 + 2.0 * f64::from(m);
            let sign = if neg { -1.0 } else { 1.0 };
            let v = sign * (base + 1.0 + low as f64 / (1u64 << 46) as f64);
            let got = <bf16 as Element>::from_f64(v);
            prop_assert_eq!(got, bf16_nearest(v));
            prop_assert_eq!(got.to_f64(), sign * (base + 2.0), "{} rounded to {}", v, got);
            let exact = sign * (base + 1.0);
            prop_assert_eq!(<bf16 as Element>::from_f64(exact), bf16::from_f32(exact as f32));
        }

        /// Widening is exact and narrowing rounds to nearest, at any byte alignment.
        #[test]
        fn widen_and_narrow_match_half(v in proptest::collection::vec(-7.0e4f32..7.0e4, 0..40), off in 0usize..2) {
            for h in [Half::BF16, Half::F16] {
                let mut bytes = vec![0u8; v.len() * 2 + off];
                h.narrow(&v, &mut bytes[off..]);
                let mut back = vec![0f32; v.len()];
                h.widen(&bytes[off..], &mut back);
                for (i, (&x, &y)) in v.iter().zip(&back).enumerate() {
                    let want = match h {
                        Half::BF16 => bf16::from_f32(x).to_f32(),
                        Half::F16 => f16::from_f32(x).to_f32(),
                    };
                    prop_assert_eq!(y.to_bits(), want.to_bits(), "{:?} element {}", h, i);
                }
            }
        }
    }
}
