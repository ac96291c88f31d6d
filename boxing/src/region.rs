//! Region arithmetic on n-d index boxes: intersection, relative offsets, element counts, and the
//! row-major contiguous runs a box covers inside a larger array.

use std::ops::Range;

use oxiflow_sbp::{Region, Shape};

/// Number of elements in a box (1 for the box of a scalar).
pub fn numel(region: &[Range<usize>]) -> usize {
    region.iter().map(|r| r.len()).product()
}

/// The box of a whole array of `shape`.
pub fn full(shape: &Shape) -> Region {
    shape.dims().iter().map(|&n| 0..n).collect()
}

/// Intersection of two boxes of the same rank; None when it holds no element.
pub fn intersect(a: &[Range<usize>], b: &[Range<usize>]) -> Option<Region> {
    let mut out = Region::new();
    for (x, y) in a.iter().zip(b) {
        let s = x.start.max(y.start);
        let e = x.end.min(y.end);
        if s >= e {
            return None;
        }
        out.push(s..e);
    }
    Some(out)
}

/// `region` expressed relative to `origin`'s start (region must lie inside origin).
pub fn relative(region: &[Range<usize>], origin: &[Range<usize>]) -> Region {
    region
        .iter()
        .zip(origin)
        .map(|(r, o)| r.start - o.start..r.end - o.start)
        .collect()
}

/// The shape of a box.
pub fn shape_of(region: &[Range<usize>]) -> Shape {
    Shape::new(region.iter().map(|r| r.len()))
}

/// Whether `region` lies inside an array of `shape`.
pub fn fits(shape: &Shape, region: &[Range<usize>]) -> bool {
    region.len() == shape.ndim()
        && region
            .iter()
            .zip(shape.dims())
            .all(|(r, &n)| r.start <= r.end && r.end <= n)
}

/// Product of the dims before `dim`: 1 means the parts of a split of `dim` are contiguous.
pub fn outer(shape: &Shape, dim: usize) -> usize {
    shape.dims()[..dim].iter().product()
}

/// The contiguous runs `(offset, len)` in elements that `region` covers in a row-major array of
/// `shape`, in row-major order of the region. Trailing dims the region covers fully are merged
/// into one run.
pub struct Runs {
    strides: smallvec::SmallVec<[usize; 6]>,
    region: Region,
    /// Number of leading dims iterated by the odometer (dims 0..k); dim k starts each run.
    k: usize,
    run: usize,
    idx: smallvec::SmallVec<[usize; 6]>,
    remaining: usize,
}

impl Runs {
    pub fn new(shape: &Shape, region: &[Range<usize>]) -> Runs {
        Runs::from_dim(shape, region, Runs::first_dim(shape, region))
    }

    /// The dim each run starts at: the smallest k such that the region covers every dim after
    /// k fully (0 for scalars).
    pub fn first_dim(shape: &Shape, region: &[Range<usize>]) -> usize {
        let nd = shape.ndim();
        if nd == 0 {
            return 0;
        }
        let mut k = nd - 1;
        while k > 0 && region[k].start == 0 && region[k].end == shape.dims()[k] {
            k -= 1;
        }
        k
    }

    /// Runs that start at dim `k`, which must be at least `first_dim(shape, region)`: two
    /// boxes of equal extents iterated with the same `k` give runs of equal lengths.
    pub fn from_dim(shape: &Shape, region: &[Range<usize>], k: usize) -> Runs {
        let strides = shape.strides();
        let total = numel(region);
        if shape.ndim() == 0 {
            return Runs {
                strides,
                region: Region::new(),
                k: 0,
                run: 1,
                idx: Default::default(),
                remaining: 1,
            };
        }
        let run = region[k].len() * strides[k];
        let remaining = if total == 0 { 0 } else { total / run };
        Runs {
            strides,
            region: region.iter().cloned().collect(),
            k,
            run,
            idx: region[..k].iter().map(|r| r.start).collect(),
            remaining,
        }
    }
    /// Length of every run.
    pub fn run_len(&self) -> usize {
        self.run
    }
}

impl Iterator for Runs {
    type Item = (usize, usize);
    fn next(&mut self) -> Option<(usize, usize)> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let k = self.k;
        let mut off = 0;
        for d in 0..k {
            off += self.idx[d] * self.strides[d];
        }
        if !self.region.is_empty() {
            off += self.region[k].start * self.strides[k];
        }
        // Advance the odometer over dims 0..k.
        let mut d = k;
        while d > 0 {
            d -= 1;
            self.idx[d] += 1;
            if self.idx[d] < self.region[d].end {
                break;
            }
            self.idx[d] = self.region[d].start;
        }
        Some((off, self.run))
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_full_trailing_dims() {
        let s = Shape::from([4, 3, 5]);
        let r: Region = [1..3, 0..3, 0..5].into_iter().collect();
        assert_eq!(Runs::new(&s, &r).collect::<Vec<_>>(), vec![(15, 30)]);
        let r: Region = [1..3, 1..2, 2..4].into_iter().collect();
        assert_eq!(
            Runs::new(&s, &r).collect::<Vec<_>>(),
            vec![(15 + 5 + 2, 2), (30 + 5 + 2, 2)]
        );
        let r: Region = [0..4, 1..3, 0..5].into_iter().collect();
        assert_eq!(Runs::new(&s, &r).count(), 4);
        let r: Region = [0..4, 1..1, 0..5].into_iter().collect();
        assert_eq!(Runs::new(&s, &r).count(), 0);
        assert_eq!(
            Runs::new(&Shape::scalar(), &[]).collect::<Vec<_>>(),
            vec![(0, 1)]
        );
    }

    #[test]
    fn intersections() {
        let a: Region = [0..4, 2..6].into_iter().collect();
        let b: Region = [3..8, 0..3].into_iter().collect();
        assert_eq!(intersect(&a, &b).unwrap().as_slice(), &[3..4, 2..3]);
        let c: Region = [4..8, 0..3].into_iter().collect();
        assert!(intersect(&a, &c).is_none());
        assert!(intersect(&[], &[]).is_some());
    }
}
