//! OneFlow's exhaustive boxing check on 2-d meshes: all pairs of 2-d nd-SBPs over
//! {S(0), S(1), B, P}^2 on [2,2], [2,3] and [4,2] meshes, random even and uneven shapes; each
//! pair runs the planner's choice and, forced, both the per-axis and the point-to-point plan.
//! Also random pairs on 3-d meshes ([2,2,2], [2,1,3]).

mod common;

use common::*;
use oxiflow_boxing::Strategy;
use oxiflow_sbp::{NdSbp, Sbp, Shape};
use proptest::prelude::*;

fn all_pairs(mesh: [usize; 2], d0: usize, d1: usize, seed: u64) -> Result<(), String> {
    let n = mesh[0] * mesh[1];
    let mut rng = SplitMix(seed);
    // Ranks in a shuffled order, so mesh order differs from rank order.
    let mut ranks: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        ranks.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let pl = cpu(&mesh, &ranks);
    let shape = Shape::from([d0, d1]);
    let global = random_global(&shape, &mut rng);
    let mut nds = Vec::new();
    for a in sbps_2d() {
        for b in sbps_2d() {
            nds.push(NdSbp::new([a, b]));
        }
    }
    let mut cases = Vec::new();
    let forces = [None, Some(Strategy::PerAxis), Some(Strategy::PointToPoint)];
    for x in &nds {
        for y in &nds {
            cases.extend(Case::each_force(
                &pl,
                &shape,
                (x, y),
                &global,
                &mut rng,
                &forces,
            ));
        }
    }
    run_cases(n, cases)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    #[test]
    fn every_pair_2x2(d0 in 0usize..=9, d1 in 1usize..=9, seed in any::<u64>()) {
        if let Err(e) = all_pairs([2, 2], d0, d1, seed) { prop_assert!(false, "{}", e); }
    }
    #[test]
    fn every_pair_2x3(d0 in 1usize..=9, d1 in 1usize..=9, seed in any::<u64>()) {
        if let Err(e) = all_pairs([2, 3], d0, d1, seed) { prop_assert!(false, "{}", e); }
    }
    #[test]
    fn every_pair_4x2(d0 in 1usize..=11, d1 in 1usize..=9, seed in any::<u64>()) {
        if let Err(e) = all_pairs([4, 2], d0, d1, seed) { prop_assert!(false, "{}", e); }
    }
}

/// Even shapes too, explicitly (proptest may not draw them).
#[test]
fn even_shapes() {
    all_pairs([2, 2], 8, 4, 1).unwrap();
    all_pairs([2, 3], 6, 12, 2).unwrap();
    all_pairs([4, 2], 8, 8, 3).unwrap();
}

/// 3-d meshes (the search is not limited to 2 axes): random nd-SBP pairs of a 3-d tensor, the
/// planner's choice and the forced per-axis plan.
fn random_3d(mesh: [usize; 3], dims: [usize; 3], seed: u64) -> Result<(), String> {
    let n: usize = mesh.iter().product();
    let mut rng = SplitMix(seed);
    let pl = cpu(&mesh, &(0..n).rev().collect::<Vec<_>>());
    let shape = Shape::from(dims);
    let global = random_global(&shape, &mut rng);
    let sbps = [Sbp::S(0), Sbp::S(1), Sbp::S(2), Sbp::B, Sbp::P];
    let pick = |rng: &mut SplitMix| NdSbp::new((0..3).map(|_| sbps[rng.below(5) as usize]));
    let mut cases = Vec::new();
    for _ in 0..10 {
        let (x, y) = (pick(&mut rng), pick(&mut rng));
        let forces = [None, Some(Strategy::PerAxis)];
        cases.extend(Case::each_force(
            &pl,
            &shape,
            (&x, &y),
            &global,
            &mut rng,
            &forces,
        ));
    }
    run_cases(n, cases)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    #[test]
    fn random_pairs_3d_mesh(d0 in 1usize..=6, d1 in 1usize..=5, d2 in 1usize..=4, seed in any::<u64>(), m in 0usize..2) {
        let mesh = [[2, 2, 2], [2, 1, 3]][m];
        if let Err(e) = random_3d(mesh, [d0, d1, d2], seed) { prop_assert!(false, "{}", e); }
    }
}
