//! `Shape`: the dims of a tensor, with element counts and row-major strides.

use std::fmt;

use smallvec::SmallVec;

/// Dims of a tensor (row-major). Scalars have no dims.
#[derive(Clone, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Shape(SmallVec<[usize; 6]>);

impl Shape {
    pub fn new(dims: impl IntoIterator<Item = usize>) -> Self {
        Shape(dims.into_iter().collect())
    }
    pub fn scalar() -> Self {
        Shape(SmallVec::new())
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn dims_mut(&mut self) -> &mut [usize] {
        &mut self.0
    }
    pub fn ndim(&self) -> usize {
        self.0.len()
    }
    pub fn dim(&self, d: usize) -> usize {
        self.0[d]
    }
    /// Number of elements (1 for a scalar, 0 if any dim is 0).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Number of elements, or None when the product of the dims overflows `usize`. The
    /// non-zero dims must multiply without overflow too (so strides fit), even when a zero dim
    /// makes the tensor empty.
    pub fn checked_numel(&self) -> Option<usize> {
        let nonzero = self
            .0
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |a, &d| a.checked_mul(d))?;
        Some(if self.0.contains(&0) { 0 } else { nonzero })
    }
    /// Size in bytes for elements of `elem_size` bytes, or None when it overflows or exceeds
    /// `isize::MAX` (the largest allocation there can be).
    pub fn checked_bytes(&self, elem_size: usize) -> Option<usize> {
        self.checked_numel()?
            .checked_mul(elem_size)
            .filter(|&b| b <= isize::MAX as usize)
    }
    /// Row-major strides in elements.
    pub fn strides(&self) -> SmallVec<[usize; 6]> {
        let mut st: SmallVec<[usize; 6]> = SmallVec::from_elem(1, self.0.len());
        for d in (0..self.0.len().saturating_sub(1)).rev() {
            st[d] = st[d + 1] * self.0[d + 1];
        }
        st
    }
    /// A copy with dim `d` set to `n`.
    pub fn with_dim(&self, d: usize, n: usize) -> Shape {
        let mut s = self.clone();
        s.0[d] = n;
        s
    }
    pub fn to_vec(&self) -> Vec<usize> {
        self.0.to_vec()
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape::new(d.iter().copied())
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape::new(d)
    }
}
impl From<&Vec<usize>> for Shape {
    fn from(d: &Vec<usize>) -> Self {
        Shape::new(d.iter().copied())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape::new(d)
    }
}
impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0.as_slice())
    }
}
impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
