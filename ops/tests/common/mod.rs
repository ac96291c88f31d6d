//! Shared helpers of the ops tests: placements and nd-SBPs drawn from seeds.

#![allow(dead_code)]

use oxiflow_placement::Placement;
use oxiflow_tensor::{DeviceType, NdSbp, Sbp};

/// A placement over mesh `mesh` with its ranks permuted by `perm`.
pub fn placement(mesh: &[usize], perm: u64) -> Placement {
    let n: usize = mesh.iter().product();
    let mut ranks: Vec<usize> = (0..n).collect();
    let mut s = perm;
    for i in (1..n).rev() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ranks.swap(i, (s >> 33) as usize % (i + 1));
    }
    Placement::new(DeviceType::Cpu, mesh.to_vec(), ranks).unwrap()
}

/// One SBP per mesh axis from `seed`: S(0..ndim), B, or (with `allow_p`) P.
pub fn nd_sbp(naxes: usize, ndim: usize, seed: u64, allow_p: bool) -> NdSbp {
    let mut s = seed;
    NdSbp::new((0..naxes).map(|_| {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        match (s >> 33) as usize % (ndim + 1 + usize::from(allow_p)) {
            d if d < ndim => Sbp::S(d),
            d if d == ndim => Sbp::B,
            _ => Sbp::P,
        }
    }))
}
