//! The balanced splitter: n items into k parts, the first n % k parts one larger.

use std::ops::Range;

/// Splits `n` items into `k` parts: base = n / k, r = n % k; parts 0..r get base + 1.
/// `20` over `6` gives 4,4,3,3,3,3; `2` over `3` gives 1,1,0 (empty parts are legal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BalancedSplitter {
    n: usize,
    k: usize,
}

impl BalancedSplitter {
    /// `k` must be at least 1.
    pub fn new(n: usize, k: usize) -> Self {
        assert!(k > 0, "BalancedSplitter needs at least one part");
        BalancedSplitter { n, k }
    }
    pub fn parts(&self) -> usize {
        self.k
    }
    /// Size of part `i`.
    pub fn size(&self, i: usize) -> usize {
        self.n / self.k + usize::from(i < self.n % self.k)
    }
    /// Start offset of part `i`.
    pub fn start(&self, i: usize) -> usize {
        let (base, r) = (self.n / self.k, self.n % self.k);
        i * base + i.min(r)
    }
    /// Range of part `i`.
    pub fn range(&self, i: usize) -> Range<usize> {
        let s = self.start(i);
        s..s + self.size(i)
    }
    /// All part sizes.
    pub fn sizes(&self) -> Vec<usize> {
        (0..self.k).map(|i| self.size(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn design_examples() {
        assert_eq!(BalancedSplitter::new(20, 6).sizes(), vec![4, 4, 3, 3, 3, 3]);
        assert_eq!(BalancedSplitter::new(2, 3).sizes(), vec![1, 1, 0]);
        assert_eq!(BalancedSplitter::new(2, 3).range(2), 2..2);
        assert_eq!(BalancedSplitter::new(20, 6).range(3), 11..14);
    }
}
