//! Pure planner tests: 1-d same-placement plans move exactly docs/design.md's table bytes, n-d plans
//! route through intermediates, the cache returns the same plan, and `explain` names steps,
//! groups and bytes.

mod common;

use common::cpu;
use oxiflow_boxing::{build_plan, BoxingError, BoxingPlanner, StepKind, Strategy};
use oxiflow_dtype::DType;
use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceOp, Sbp};

/// docs/design.md's table, bytes received per rank, for p ranks and |T| bytes.
fn table(from: Sbp, to: Sbp, t: u64, p: u64) -> u64 {
    if from == to || p == 1 {
        return 0;
    }
    match (from, to) {
        (Sbp::Split(_), Sbp::Broadcast) => (p - 1) * t / p,
        (Sbp::Partial(_), Sbp::Broadcast) => 2 * (p - 1) * t / p,
        (Sbp::Partial(_), Sbp::Split(_)) => (p - 1) * t / p,
        (Sbp::Split(_), Sbp::Split(_)) => (p - 1) * t / (p * p),
        (Sbp::Broadcast, _) | (Sbp::Split(_), Sbp::Partial(_)) => 0,
        (Sbp::Partial(_), Sbp::Partial(_)) => 2 * (p - 1) * t / p,
    }
}

#[test]
fn one_d_bytes_equal_table_minimum() {
    let sbps = [
        Sbp::S(0),
        Sbp::S(1),
        Sbp::B,
        Sbp::P,
        Sbp::Partial(ReduceOp::Max),
    ];
    for p in 1..=8usize {
        let pl = cpu(&[p], &(0..p).collect::<Vec<_>>());
        // Even: every dim divisible by p and p^2.
        let shape = [p * p * 2, p * p * 3];
        let t = (shape[0] * shape[1] * 4) as u64;
        for a in sbps {
            for b in sbps {
                let from = GlobalLayout::new(shape, &pl, a).unwrap();
                let to = GlobalLayout::new(shape, &pl, b).unwrap();
                let plan = build_plan(&from, &to, DType::F32).unwrap();
                if a.is_partial() && b.is_partial() && a != b {
                    // Not in docs/design.md's table; the planner finds reduce-scatter then a local
                    // identity fill, cheaper than the all-reduce route the cost model prices.
                    assert!(
                        plan.bytes_max() <= table(a, b, t, p as u64),
                        "{a} -> {b}:\n{}",
                        plan.explain()
                    );
                    continue;
                }
                assert_eq!(
                    plan.bytes_max(),
                    table(a, b, t, p as u64),
                    "{a} -> {b} on {p} ranks:\n{}",
                    plan.explain()
                );
                if a != b && p > 1 {
                    assert_eq!(
                        plan.strategy,
                        Strategy::PerAxis,
                        "{a} -> {b}:\n{}",
                        plan.explain()
                    );
                    assert_eq!(plan.steps.len(), 1, "{a} -> {b}:\n{}", plan.explain());
                }
            }
        }
    }
}

#[test]
fn two_d_transitions_route_through_intermediates() {
    let pl = cpu(&[2, 2], &[0, 1, 2, 3]);
    let from = GlobalLayout::new([8, 8], &pl, [Sbp::S(0), Sbp::S(1)]).unwrap();
    let to = GlobalLayout::new([8, 8], &pl, [Sbp::S(1), Sbp::S(0)]).unwrap();
    let plan = build_plan(&from, &to, DType::F32).unwrap();
    println!("{}", plan.explain());
    assert!(plan.bytes_max() > 0);

    let from = GlobalLayout::new([8, 8], &pl, [Sbp::S(0), Sbp::P]).unwrap();
    let to = GlobalLayout::new([8, 8], &pl, [Sbp::S(0), Sbp::S(0)]).unwrap();
    let plan = build_plan(&from, &to, DType::F32).unwrap();
    println!("{}", plan.explain());
    // A single reduce-scatter on axis 1 of the 4x8 group tensor: (2-1)/2 * 128 bytes.
    assert_eq!(plan.strategy, Strategy::PerAxis);
    assert_eq!(plan.steps.len(), 1);
    assert!(matches!(
        plan.steps[0].kind,
        StepKind::ReduceScatter { dim: 0, .. }
    ));
    assert_eq!(plan.bytes_max(), 64);

    // (S(0), S(0)) -> (S(1), S(0)): axis 0 cannot change first (axis 1 splits dim 0).
    let from = GlobalLayout::new([8, 8], &pl, [Sbp::S(0), Sbp::S(0)]).unwrap();
    let to = GlobalLayout::new([8, 8], &pl, [Sbp::S(1), Sbp::S(0)]).unwrap();
    let plan = build_plan(&from, &to, DType::F32).unwrap();
    println!("{}", plan.explain());
    assert!(plan.bytes_max() > 0);
}

#[test]
fn different_placements_plan_point_to_point() {
    let a = cpu(&[2, 2], &[0, 1, 2, 3]);
    let b = cpu(&[3], &[3, 4, 5]);
    let from = GlobalLayout::new([6, 4], &a, [Sbp::S(0), Sbp::P]).unwrap();
    let to = GlobalLayout::new([6, 4], &b, Sbp::S(1)).unwrap();
    let plan = build_plan(&from, &to, DType::F64).unwrap();
    println!("{}", plan.explain());
    assert_eq!(plan.strategy, Strategy::PointToPoint);
    let StepKind::P2p(p) = &plan.steps[0].kind else {
        panic!("expected p2p")
    };
    assert_eq!(p.union, vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(p.reduce, Some(ReduceOp::Sum));
    assert!(plan.explain().contains("p2p-intersections"));
}

#[test]
fn cache_returns_same_plan() {
    let planner = BoxingPlanner::new();
    let pl = cpu(&[4], &[0, 1, 2, 3]);
    let from = GlobalLayout::new([8], &pl, Sbp::S(0)).unwrap();
    let to = GlobalLayout::new([8], &pl, Sbp::B).unwrap();
    let p1 = planner.plan(&from, &to, DType::F32).unwrap();
    let p2 = planner.plan(&from, &to, DType::F32).unwrap();
    assert!(std::sync::Arc::ptr_eq(&p1, &p2));
    let p3 = planner.plan(&from, &to, DType::F64).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&p1, &p3));
    assert_eq!(planner.len(), 2);
}

#[test]
fn planning_errors_are_typed() {
    let pl = cpu(&[2], &[0, 1]);
    let from = GlobalLayout::new([4], &pl, Sbp::S(0)).unwrap();
    let to = GlobalLayout::new([4, 1], &pl, Sbp::B).unwrap();
    assert!(matches!(
        build_plan(&from, &to, DType::F32),
        Err(BoxingError::ShapeMismatch { .. })
    ));
    let pl2 = cpu(&[2, 1], &[0, 1]);
    let mixed =
        GlobalLayout::new([4], &pl2, NdSbp::new([Sbp::P, Sbp::Partial(ReduceOp::Max)])).unwrap();
    let b = GlobalLayout::new([4], &pl2, [Sbp::B, Sbp::B]).unwrap();
    let err = build_plan(&mixed, &b, DType::F32).unwrap_err();
    assert!(matches!(err, BoxingError::MixedPartial { .. }), "{err}");
    assert!(err.to_string().contains("(P, P(max))"));
}

#[test]
fn forced_per_axis_routes_and_device_change() {
    let pl = cpu(&[2, 2], &[0, 1, 2, 3]);
    for (a, b) in [
        ([Sbp::S(0), Sbp::S(1)], [Sbp::S(1), Sbp::S(0)]),
        ([Sbp::S(0), Sbp::S(0)], [Sbp::S(1), Sbp::S(0)]),
    ] {
        let from = GlobalLayout::new([8, 8], &pl, a).unwrap();
        let to = GlobalLayout::new([8, 8], &pl, b).unwrap();
        let plan =
            oxiflow_boxing::build_plan_with(&from, &to, DType::F32, Strategy::PerAxis).unwrap();
        println!("{}", plan.explain());
        // Every step is a valid single-axis step and the chain ends at the target.
        assert_eq!(plan.steps.last().unwrap().after.nd_sbp(), to.nd_sbp());
        for w in plan.steps.windows(2) {
            assert_eq!(w[0].after.nd_sbp(), w[1].before.nd_sbp());
        }
        // The planner's choice is never dearer than the per-axis plan.
        assert!(build_plan(&from, &to, DType::F32).unwrap().bytes_max() <= plan.bytes_max());
    }
    // (S(0), S(0)) -> (S(1), S(0)) must go through an intermediate: 3 steps via (S(0), B).
    let from = GlobalLayout::new([8, 8], &pl, [Sbp::S(0), Sbp::S(0)]).unwrap();
    let to = GlobalLayout::new([8, 8], &pl, [Sbp::S(1), Sbp::S(0)]).unwrap();
    let plan = oxiflow_boxing::build_plan_with(&from, &to, DType::F32, Strategy::PerAxis).unwrap();
    assert_eq!(
        plan.steps[0].after.nd_sbp(),
        &NdSbp::new([Sbp::S(0), Sbp::B])
    );

    let gpu = pl.with_device(oxiflow_placement::DeviceType::Cuda);
    let from = GlobalLayout::new([8, 8], &pl, [Sbp::S(0), Sbp::B]).unwrap();
    let to = GlobalLayout::new([8, 8], &gpu, [Sbp::B, Sbp::B]).unwrap();
    let plan = build_plan(&from, &to, DType::F32).unwrap();
    println!("{}", plan.explain());
    assert!(matches!(plan.steps[0].kind, StepKind::DeviceCopy { .. }));
    assert!(matches!(plan.steps[1].kind, StepKind::AllGather { dim: 0 }));
    let back = build_plan(&to, &from, DType::F32).unwrap();
    assert!(matches!(
        back.steps.last().unwrap().kind,
        StepKind::DeviceCopy { .. }
    ));
}
