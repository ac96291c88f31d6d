//! Counter-based random numbers: Philox4x32-10 keyed by the seed, counter = global element
//! index, so a random tensor's value does not depend on placement, SBP or device; and
//! `ElementInit`, how creation ops compute element `i` from them.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// Philox4x32 with 10 rounds: four 32-bit words from a 128-bit counter and a 64-bit key.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for r in 0..10 {
        if r > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

fn words(seed: u64, index: u64) -> [u32; 4] {
    philox4x32_10(
        [index as u32, (index >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// Uniform in [0, 1) with 53 random bits, for element `index` of a tensor seeded by `seed`.
pub fn uniform(seed: u64, index: u64) -> f64 {
    let w = words(seed, index);
    let bits = (u64::from(w[0]) << 21) ^ u64::from(w[1] >> 11);
    (bits & ((1u64 << 53) - 1)) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal by Box-Muller from the counter's first two words (cosine branch).
pub fn normal(seed: u64, index: u64) -> f64 {
    let w = words(seed, index);
    // u1 in (0, 1] so the log is finite; u2 in [0, 1).
    let u1 = (f64::from(w[0]) + 1.0) / 4_294_967_296.0;
    let u2 = f64::from(w[1]) / 4_294_967_296.0;
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// How element `i` (global row-major index) of a created tensor is computed (device backends
/// compute the same values; see `DeviceBackend::create`).
#[derive(Clone, Copy, Debug)]
pub enum ElementInit {
    /// Every element `v`.
    Full(f64),
    /// `start + step * i`.
    Arange { start: f64, step: f64 },
    /// `uniform(seed, i)`.
    Rand(u64),
    /// `normal(seed, i)`.
    Randn(u64),
}

impl ElementInit {
    /// Element `i`'s value.
    #[inline]
    pub fn at(self, i: u64) -> f64 {
        match self {
            ElementInit::Full(v) => v,
            ElementInit::Arange { start, step } => start + step * i as f64,
            ElementInit::Rand(seed) => uniform(seed, i),
            ElementInit::Randn(seed) => normal(seed, i),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Random123 known-answer test vectors for philox4x32_10.
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([0xffffffff; 4], [0xffffffff; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn normal_moments() {
        let n = 20000;
        let xs: Vec<f64> = (0..n).map(|i| normal(7, i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
        let us: Vec<f64> = (0..n).map(|i| uniform(7, i)).collect();
        assert!(us.iter().all(|&u| (0.0..1.0).contains(&u)));
    }
}
