//! Boxing across placements on the in-process backend: random pairs of placements (overlapping,
//! disjoint, 1 <-> n ranks, different mesh shapes, shuffled rank orders) with random nd-SBPs;
//! ranks outside both placements take part in nothing and get nothing.

mod common;

use common::*;
use oxiflow_placement::Placement;
use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceOp, Sbp, Shape};
use proptest::prelude::*;

fn random_placement(world: usize, rng: &mut SplitMix) -> Placement {
    let mut ranks: Vec<usize> = (0..world).collect();
    for i in (1..world).rev() {
        ranks.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let k = 1 + rng.below(world as u64) as usize;
    ranks.truncate(k);
    let divisors: Vec<usize> = (1..=k).filter(|d| k.is_multiple_of(*d)).collect();
    let rows = divisors[rng.below(divisors.len() as u64) as usize];
    let mesh = if rng.below(2) == 0 || rows == 1 || rows == k {
        vec![k]
    } else {
        vec![rows, k / rows]
    };
    cpu(&mesh, &ranks)
}

fn random_nd(pl: &Placement, ndim: usize, op: ReduceOp, rng: &mut SplitMix) -> NdSbp {
    NdSbp::new((0..pl.ndim()).map(|_| match rng.below(ndim as u64 + 2) {
        x if (x as usize) < ndim => Sbp::S(x as usize),
        x if x as usize == ndim => Sbp::B,
        _ => Sbp::Partial(op),
    }))
}

fn cases(world: usize, shape: &Shape, n: usize, rng: &mut SplitMix) -> Vec<Case> {
    let global = random_global(shape, rng);
    (0..n)
        .map(|i| {
            let op =
                [ReduceOp::Sum, ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][rng.below(4) as usize];
            let (a, b) = (random_placement(world, rng), random_placement(world, rng));
            // Force the 1 <-> n shapes now and then.
            let a = if i % 5 == 0 {
                cpu(&[1], &[a.ranks()[0]])
            } else {
                a
            };
            let b = if i % 7 == 3 {
                cpu(&[1], &[b.ranks()[0]])
            } else {
                b
            };
            Case {
                from: GlobalLayout::new(shape.clone(), &a, random_nd(&a, shape.ndim(), op, rng))
                    .unwrap(),
                to: GlobalLayout::new(shape.clone(), &b, random_nd(&b, shape.ndim(), op, rng))
                    .unwrap(),
                dtype: dtype_of(rng.next()),
                global: global.clone(),
                seed: rng.next(),
                force: None,
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_placement_pairs(world in 2usize..=7, d0 in 0usize..=9, d1 in 1usize..=7, seed in any::<u64>()) {
        let mut rng = SplitMix(seed);
        let shape = Shape::from([d0, d1]);
        let cs = cases(world, &shape, 12, &mut rng);
        if let Err(e) = run_cases(world, cs) { prop_assert!(false, "{}", e); }
    }
}

#[test]
fn fixed_placement_moves() {
    let shape = Shape::from([7, 5]);
    let mut rng = SplitMix(11);
    let global = random_global(&shape, &mut rng);
    let l = |pl: Placement, nd: NdSbp| GlobalLayout::new(shape.clone(), &pl, nd).unwrap();
    let pairs = vec![
        // disjoint, 2-d P source to 1-d split target
        (
            l(cpu(&[2, 2], &[0, 1, 2, 3]), NdSbp::new([Sbp::S(0), Sbp::P])),
            l(cpu(&[2], &[4, 5]), Sbp::S(1).into()),
        ),
        // overlapping
        (
            l(cpu(&[3], &[1, 2, 3]), Sbp::P.into()),
            l(cpu(&[2, 2], &[2, 3, 4, 5]), NdSbp::new([Sbp::B, Sbp::S(0)])),
        ),
        // 1 -> n and n -> 1
        (
            l(cpu(&[1], &[5]), Sbp::B.into()),
            l(cpu(&[6], &[0, 1, 2, 3, 4, 5]), Sbp::S(0).into()),
        ),
        (
            l(
                cpu(&[3, 2], &[5, 4, 3, 2, 1, 0]),
                NdSbp::new([Sbp::P, Sbp::S(1)]),
            ),
            l(cpu(&[1], &[0]), Sbp::B.into()),
        ),
        // same ranks, other mesh shape, target P
        (
            l(cpu(&[4], &[0, 1, 2, 3]), Sbp::S(1).into()),
            l(cpu(&[2, 2], &[3, 2, 1, 0]), NdSbp::new([Sbp::P, Sbp::S(0)])),
        ),
    ];
    let cases = pairs
        .into_iter()
        .enumerate()
        .map(|(i, (from, to))| Case {
            from,
            to,
            dtype: dtype_of(i as u64),
            global: global.clone(),
            seed: i as u64,
            force: None,
        })
        .collect();
    run_cases(6, cases).unwrap();
}
