//! 16-bit boxing that sums partial values (P -> B and P -> S on 1-d and 2-d meshes, uneven and
//! empty shards, P to a disjoint placement) gives the exact sum of the components rounded once
//! to 16 bits, the same bits on every rank holding a copy. The component values have 8
//! significant bits at scales 1 to 2^-6, so their sums are exact in f32 but not in 16 bits:
//! a path that rounded a partial sum would differ.

mod common;

use std::collections::BTreeMap;

use common::*;
use oxiflow_dtype::{bf16, f16, DType};
use oxiflow_sbp::{GlobalLayout, NdSbp, Sbp, Shape};
use proptest::prelude::*;

/// (world, from mesh + ranks, from nd-SBP, to mesh + ranks, to nd-SBP).
type Transition = (
    usize,
    (Vec<usize>, Vec<usize>),
    Vec<Sbp>,
    (Vec<usize>, Vec<usize>),
    Vec<Sbp>,
);

fn transitions() -> Vec<Transition> {
    let line = |n: usize| (vec![n], (0..n).collect::<Vec<_>>());
    let grid = |a: usize, b: usize| (vec![a, b], (0..a * b).collect::<Vec<_>>());
    let (p, b) = (Sbp::P, Sbp::B);
    let mut out = Vec::new();
    for n in 2..=5 {
        out.push((n, line(n), vec![p], line(n), vec![b]));
        out.push((n, line(n), vec![p], line(n), vec![Sbp::S(0)]));
        out.push((n, line(n), vec![p], line(n), vec![Sbp::S(1)]));
    }
    out.push((4, grid(2, 2), vec![p, p], grid(2, 2), vec![b, b]));
    out.push((
        4,
        grid(2, 2),
        vec![p, Sbp::S(0)],
        grid(2, 2),
        vec![b, Sbp::S(0)],
    ));
    out.push((
        4,
        grid(2, 2),
        vec![p, p],
        grid(2, 2),
        vec![Sbp::S(0), Sbp::S(1)],
    ));
    out.push((4, grid(2, 2), vec![Sbp::S(1), p], grid(2, 2), vec![b, b]));
    out.push((6, grid(2, 3), vec![p, p], grid(2, 3), vec![Sbp::S(0), b]));
    // Partial values on one placement, the sum on a disjoint one (point-to-point moves).
    out.push((
        5,
        (vec![3], vec![0, 1, 2]),
        vec![p],
        (vec![2], vec![3, 4]),
        vec![b],
    ));
    out.push((
        5,
        (vec![2], vec![0, 1]),
        vec![p],
        (vec![3], vec![2, 3, 4]),
        vec![Sbp::S(0)],
    ));
    out.push((
        6,
        (vec![2, 2], vec![0, 1, 2, 3]),
        vec![p, p],
        (vec![2], vec![4, 5]),
        vec![Sbp::S(1)],
    ));
    out
}

/// 8 significant bits at a scale of 2^0..2^-6: exact in bf16 and f16.
fn component_value(rng: &mut SplitMix) -> f64 {
    (rng.below(255) as f64 - 127.0) / f64::from(1u32 << rng.below(7))
}

fn rounded(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::BF16 => bf16::from_f32(x as f32).to_f64(),
        _ => f16::from_f32(x as f32).to_f64(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn partial_sums_of_16_bit_values_round_once(
        t in 0usize..16, rows in 0usize..6, cols in 0usize..7, half in 0usize..2, seed in any::<u64>(),
    ) {
        let all = transitions();
        let (world, (fm, fr), fnd, (tm, tr), tnd) = all[t % all.len()].clone();
        let dtype = [DType::BF16, DType::F16][half];
        let shape = Shape::new([rows, cols]);
        let from = GlobalLayout::new(shape.clone(), &cpu(&fm, &fr), NdSbp::new(fnd)).unwrap();
        let to = GlobalLayout::new(shape.clone(), &cpu(&tm, &tr), NdSbp::new(tnd)).unwrap();
        let mut rng = SplitMix(seed);
        let mut comps: BTreeMap<Vec<usize>, Vec<f64>> = BTreeMap::new();
        for idx in 0..from.placement().num_ranks() {
            let key = partial_key(from.nd_sbp(), &from.placement().coord_of_index(idx));
            comps.entry(key).or_insert_with(|| (0..shape.numel()).map(|_| component_value(&mut rng)).collect());
        }
        let want: Vec<f64> = (0..shape.numel())
            .map(|i| rounded(dtype, comps.values().map(|c| c[i]).sum()))
            .collect();
        let inputs = pieces_of_components(&from, &comps, dtype);
        let out = box_pieces(world, &from, &to, dtype, inputs).map_err(TestCaseError::fail)?;
        prop_assert!(out.values().all(|p| p.data.dtype() == dtype));
        let got = reassemble(&to, &out).map_err(TestCaseError::fail)?;
        prop_assert_eq!(got, want, "{} -> {} ({})", from, to, dtype);
    }
}
