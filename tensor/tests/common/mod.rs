//! Shared helpers of the tensor integration tests: placements and nd-SBPs from seeds, and array
//! comparison with an f32 tolerance.

#![allow(dead_code)]

use ndarray::ArrayD;
use oxiflow_tensor::{DeviceType, NdSbp, Placement, Sbp};

/// A placement over `n` ranks of mesh `mesh` (product = n), ranks permuted by `perm_seed`.
pub fn placement(mesh: &[usize], perm_seed: u64) -> Placement {
    let n: usize = mesh.iter().product();
    let mut ranks: Vec<usize> = (0..n).collect();
    let mut s = perm_seed;
    for i in (1..n).rev() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let j = (s >> 33) as usize % (i + 1);
        ranks.swap(i, j);
    }
    Placement::new(DeviceType::Cpu, mesh.to_vec(), ranks).unwrap()
}

/// One SBP per mesh axis chosen by `seed` among S(0..ndim), B, P (P only when `allow_p`).
pub fn nd_sbp(naxes: usize, ndim: usize, seed: u64, allow_p: bool) -> NdSbp {
    let mut s = seed;
    NdSbp::new((0..naxes).map(|_| {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let k = ndim + 1 + usize::from(allow_p);
        match (s >> 33) as usize % k {
            d if d < ndim => Sbp::S(d),
            d if d == ndim => Sbp::B,
            _ => Sbp::P,
        }
    }))
}

/// Element-wise closeness with an f32 tolerance.
pub fn assert_close(got: &ArrayD<f32>, want: &ArrayD<f32>, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
        let tol = 2e-4 * (1.0 + w.abs());
        assert!(
            (g - w).abs() <= tol || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// Whether every rank's outputs (`got[rank][output]`) equal the one-rank values `want[output]`
/// within a relative 1e-9; the first difference otherwise.
pub fn ranks_match(got: &[Vec<Vec<f64>>], want: &[Vec<f64>]) -> Result<(), String> {
    for (rank, outs) in got.iter().enumerate() {
        if outs.len() != want.len() {
            return Err(format!(
                "rank {rank}: {} outputs, want {}",
                outs.len(),
                want.len()
            ));
        }
        for (o, (g, w)) in outs.iter().zip(want).enumerate() {
            if g.len() != w.len() {
                return Err(format!(
                    "rank {rank} output {o}: {} values, want {}",
                    g.len(),
                    w.len()
                ));
            }
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                if (a - b).abs() >= 1e-9 * (1.0 + b.abs()) {
                    return Err(format!("rank {rank} output {o} [{i}]: {a} vs {b}"));
                }
            }
        }
    }
    Ok(())
}
