//! Element types the collectives (and tensors) move: `DType` and the `Element` trait.

use std::fmt;

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F64,
    I64,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
        }
    }
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Rust scalar type that has a `DType`.
pub trait Element: bytemuck::Pod + Copy + Send + Sync + PartialOrd + fmt::Debug + 'static {
    const DTYPE: DType;
    fn zero() -> Self;
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
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn zero() -> Self {
        0.0
    }
    fn add(self, o: Self) -> Self {
        self + o
    }
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn zero() -> Self {
        0.0
    }
    fn add(self, o: Self) -> Self {
        self + o
    }
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
    fn zero() -> Self {
        0
    }
    fn add(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
}
