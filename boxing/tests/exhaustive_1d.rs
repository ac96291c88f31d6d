//! OneFlow's exhaustive boxing check on 1-d meshes: every (source, target) pair over
//! {S(0), S(1), B, P} on 1..8 ranks, random even and uneven shapes (dims smaller than the mesh
//! included), on the in-process backend; the global value must not change.

mod common;

use common::*;
use oxiflow_boxing::Strategy;
use oxiflow_sbp::{GlobalLayout, ReduceOp, Sbp, Shape};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn every_pair_1d(n in 1usize..=8, d0 in 0usize..=10, d1 in 1usize..=9, seed in any::<u64>()) {
        let (_, shape, pl, global) = random_on_line(n, (d0, d1), seed);
        let mut cases = Vec::new();
        for (i, a) in sbps_2d().into_iter().enumerate() {
            for (j, b) in sbps_2d().into_iter().enumerate() {
                for force in [None, Some(Strategy::PointToPoint)] {
                    cases.push(Case {
                        from: GlobalLayout::new(shape.clone(), &pl, a).unwrap(),
                        to: GlobalLayout::new(shape.clone(), &pl, b).unwrap(),
                        dtype: dtype_of(seed.wrapping_add((i * 4 + j) as u64)),
                        global: global.clone(),
                        seed: seed ^ (i * 4 + j) as u64,
                        force,
                    });
                }
            }
        }
        if let Err(e) = run_cases(n, cases) {
            prop_assert!(false, "{}", e);
        }
    }

    #[test]
    fn max_min_partials_1d(n in 2usize..=5, d0 in 1usize..=7, d1 in 1usize..=5, seed in any::<u64>()) {
        let (mut rng, shape, pl, global) = random_on_line(n, (d0, d1), seed);
        let pmax = Sbp::Partial(ReduceOp::Max);
        let pmin = Sbp::Partial(ReduceOp::Min);
        let all = [Sbp::S(0), Sbp::S(1), Sbp::B, Sbp::P, pmax, pmin];
        let mut cases = Vec::new();
        for a in all {
            for b in all {
                if !(a.partial_op().is_some_and(|o| o != ReduceOp::Sum) || b.partial_op().is_some_and(|o| o != ReduceOp::Sum)) {
                    continue;
                }
                cases.push(Case::on(&pl, &shape, (a, b), &global, &mut rng, None));
            }
        }
        if let Err(e) = run_cases(n, cases) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// 1-d tensors and scalars: only S(0), B, P apply.
#[test]
fn vectors_and_scalars() {
    let mut rng = SplitMix(7);
    for n in [1usize, 3, 4] {
        let pl = cpu(&[n], &(0..n).collect::<Vec<_>>());
        let mut cases = Vec::new();
        for shape in [Shape::from([5]), Shape::from([2]), Shape::scalar()] {
            let sbps: Vec<Sbp> = if shape.ndim() == 0 {
                vec![Sbp::B, Sbp::P]
            } else {
                vec![Sbp::S(0), Sbp::B, Sbp::P]
            };
            let global = random_global(&shape, &mut rng);
            for &a in &sbps {
                for &b in &sbps {
                    cases.push(Case::on(&pl, &shape, (a, b), &global, &mut rng, None));
                }
            }
        }
        run_cases(n, cases).unwrap();
    }
}
