//! `Arr`: a plain row-major f64 array with the index helpers the reference ops need.

use std::ops::Range;

#[derive(Clone, Debug, PartialEq)]
pub struct Arr {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1] * shape[d + 1];
    }
    st
}

/// Multi-index of flat position `flat` in `shape`.
pub fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        if shape[d] > 0 {
            idx[d] = flat % shape[d];
            flat /= shape[d];
        }
    }
    idx
}

impl Arr {
    pub fn new(shape: Vec<usize>, data: Vec<f64>) -> Self {
        assert_eq!(
            numel(&shape),
            data.len(),
            "shape {shape:?} vs {} values",
            data.len()
        );
        Arr { shape, data }
    }
    pub fn full(shape: &[usize], v: f64) -> Self {
        Arr::new(shape.to_vec(), vec![v; numel(shape)])
    }
    /// Deterministic pseudo-random values in `lo..hi`.
    pub fn random(shape: &[usize], seed: u64, lo: f64, hi: f64) -> Self {
        let data = (0..numel(shape))
            .map(|i| lo + (hi - lo) * hash01(seed, i as u64, 0))
            .collect();
        Arr::new(shape.to_vec(), data)
    }
    /// Deterministic pseudo-random integers in `0..bound` (as f64).
    pub fn random_ints(shape: &[usize], seed: u64, bound: usize) -> Self {
        let data = (0..numel(shape))
            .map(|i| {
                ((hash01(seed, i as u64, 7) * bound as f64) as usize).min(bound.saturating_sub(1))
                    as f64
            })
            .collect();
        Arr::new(shape.to_vec(), data)
    }
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    pub fn at(&self, idx: &[usize]) -> f64 {
        let st = strides(&self.shape);
        self.data[idx.iter().zip(&st).map(|(i, s)| i * s).sum::<usize>()]
    }
    pub fn offset(&self, idx: &[usize]) -> usize {
        let st = strides(&self.shape);
        idx.iter().zip(&st).map(|(i, s)| i * s).sum()
    }
    /// The sub-array of the given index ranges.
    pub fn region(&self, ranges: &[Range<usize>]) -> Arr {
        let shape: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
        let data = (0..numel(&shape))
            .map(|f| {
                let idx: Vec<usize> = unravel(f, &shape)
                    .iter()
                    .zip(ranges)
                    .map(|(i, r)| i + r.start)
                    .collect();
                self.at(&idx)
            })
            .collect();
        Arr::new(shape, data)
    }
    /// Keep `range` of dim `d`.
    pub fn narrow(&self, d: usize, range: Range<usize>) -> Arr {
        let mut ranges: Vec<Range<usize>> = self.shape.iter().map(|&n| 0..n).collect();
        ranges[d] = range;
        self.region(&ranges)
    }
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Arr {
        Arr::new(
            self.shape.clone(),
            self.data.iter().map(|&x| f(x)).collect(),
        )
    }
    /// Element-wise combination of equal shapes.
    pub fn zip(&self, o: &Arr, f: impl Fn(f64, f64) -> f64) -> Result<Arr, String> {
        if self.shape != o.shape {
            return Err(format!("zip of shapes {:?} and {:?}", self.shape, o.shape));
        }
        Ok(Arr::new(
            self.shape.clone(),
            self.data
                .iter()
                .zip(&o.data)
                .map(|(&a, &b)| f(a, b))
                .collect(),
        ))
    }
}

/// Concatenation along `d`; every other dim must agree.
pub fn concat(parts: &[Arr], d: usize) -> Result<Arr, String> {
    let first = &parts[0];
    for p in parts {
        let ok = p.ndim() == first.ndim()
            && (0..p.ndim()).all(|i| i == d || p.shape[i] == first.shape[i]);
        if !ok {
            return Err(format!(
                "concat along {d} of shapes {:?} and {:?}",
                first.shape, p.shape
            ));
        }
    }
    let mut shape = first.shape.clone();
    shape[d] = parts.iter().map(|p| p.shape[d]).sum();
    let mut data = Vec::with_capacity(numel(&shape));
    for f in 0..numel(&shape) {
        let mut idx = unravel(f, &shape);
        let mut k = 0;
        while idx[d] >= parts[k].shape[d] {
            idx[d] -= parts[k].shape[d];
            k += 1;
        }
        data.push(parts[k].at(&idx));
    }
    Ok(Arr::new(shape, data))
}

/// A hash-based uniform value in [0, 1).
pub fn hash01(seed: u64, i: u64, salt: u64) -> f64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(salt.wrapping_mul(0x94D0_49BB_1331_11EB));
    z ^= z >> 30;
    z = z.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 27;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Equal up to rounding; NaNs and equal infinities match.
pub fn close(a: &Arr, b: &Arr) -> bool {
    a.shape == b.shape
        && a.data.iter().zip(&b.data).all(|(&x, &y)| {
            (x.is_nan() && y.is_nan())
                || x == y
                || (x - y).abs() <= 1e-7 * (1.0 + x.abs().max(y.abs()))
        })
}
