//! Bad input gives the same typed error on every rank, before any communication: no rank waits
//! in a collective (the world's timeout is 30 s; every rank must return within 2 s).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use oxiflow_boxing::{boxing, BoxingError, BoxingPlanner, HostData, HostPiece};
use oxiflow_collectives::InProcessWorld;
use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceOp, Sbp, Shape};

/// Runs `f(rank)` on every rank of a 4-rank in-process world; returns each rank's result and
/// the slowest rank's time.
fn on_all<F>(f: F) -> (Vec<Result<Option<HostPiece>, BoxingError>>, Duration)
where
    F: Fn(
            usize,
            &oxiflow_collectives::SharedComm,
            &BoxingPlanner,
        ) -> Result<Option<HostPiece>, BoxingError>
        + Send
        + Sync
        + 'static,
{
    let comms = InProcessWorld::new(4, Duration::from_secs(30));
    let f = Arc::new(f);
    let start = Instant::now();
    let hs: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let f = f.clone();
            std::thread::spawn(move || f(r, &c, &BoxingPlanner::new()))
        })
        .collect();
    let res = hs.into_iter().map(|h| h.join().unwrap()).collect();
    (res, start.elapsed())
}

fn piece(shape: &[usize], dtype: DType) -> HostPiece {
    let n = shape.iter().product();
    HostPiece::new(shape.to_vec(), HostData::F64(vec![1.0; n]).to_dtype(dtype)).unwrap()
}

fn all_err(
    res: &[Result<Option<HostPiece>, BoxingError>],
    t: Duration,
    want: impl Fn(&BoxingError) -> bool,
) {
    assert!(
        t < Duration::from_secs(2),
        "ranks took {t:?}: someone waited in a collective"
    );
    for (r, x) in res.iter().enumerate() {
        match x {
            Err(e) if want(e) => println!("rank {r}: {e}"),
            other => panic!("rank {r}: unexpected {other:?}"),
        }
    }
}

#[test]
fn target_sbp_that_does_not_fit_the_shape() {
    let (res, t) = on_all(|r, w, planner| {
        let pl = cpu(&[4], &[0, 1, 2, 3]);
        let shape = Shape::from([8]);
        let plan = planner.plan_parts(
            &shape,
            (&pl, &Sbp::S(0).into()),
            (&pl, &Sbp::S(1).into()),
            DType::F32,
        )?;
        boxing_plan(&plan, w, Some(piece(&[2], DType::F32)), r)
    });
    all_err(&res, t, |e| {
        matches!(e, BoxingError::Layout(_)) && e.to_string().contains("S(1)")
    });
    let (res, t) = on_all(|r, w, planner| {
        let pl = cpu(&[2, 2], &[0, 1, 2, 3]);
        let shape = Shape::from([8]);
        // nd-SBP of the wrong length for the mesh.
        let plan = planner.plan_parts(
            &shape,
            (&pl, &NdSbp::new([Sbp::S(0), Sbp::B])),
            (&pl, &Sbp::B.into()),
            DType::F32,
        )?;
        boxing_plan(&plan, w, Some(piece(&[4], DType::F32)), r)
    });
    all_err(&res, t, |e| matches!(e, BoxingError::Layout(_)));
}

fn boxing_plan(
    plan: &oxiflow_boxing::Plan,
    w: &oxiflow_collectives::SharedComm,
    p: Option<HostPiece>,
    _rank: usize,
) -> Result<Option<HostPiece>, BoxingError> {
    oxiflow_boxing::execute(plan, w, p)
}

/// One side of a boxing: the placement, the global shape and the nd-SBP.
type Side = (Placement, &'static [usize], NdSbp);

/// Boxes, on every rank, a piece of shape `held.0` and dtype `held.1` from `from` to `to` as
/// `dtype`; every rank must fail fast with an error `want` accepts.
fn boxing_fails(
    from: Side,
    to: Side,
    dtype: DType,
    held: (&'static [usize], DType),
    want: impl Fn(&BoxingError) -> bool,
) {
    let (res, t) = on_all(move |_, w, planner| {
        let from = GlobalLayout::new(from.1, &from.0, from.2.clone())?;
        let to = GlobalLayout::new(to.1, &to.0, to.2.clone())?;
        boxing(planner, w, &from, &to, dtype, Some(piece(held.0, held.1)))
    });
    all_err(&res, t, want);
}

#[test]
fn placement_naming_ranks_outside_the_world() {
    boxing_fails(
        (cpu(&[4], &[0, 1, 2, 3]), &[8], Sbp::S(0).into()),
        (
            cpu(&[2, 2], &[0, 1, 2, 7]),
            &[8],
            NdSbp::new([Sbp::S(0), Sbp::B]),
        ),
        DType::F32,
        (&[2], DType::F32),
        |e| matches!(e, BoxingError::RankOutsideWorld { rank: 7, .. }),
    );
}

#[test]
fn mixed_partial_and_shape_mismatch() {
    let pl = cpu(&[2, 2], &[0, 1, 2, 3]);
    boxing_fails(
        (
            pl.clone(),
            &[4],
            NdSbp::new([Sbp::P, Sbp::Partial(ReduceOp::Max)]),
        ),
        (pl, &[4], NdSbp::new([Sbp::B, Sbp::B])),
        DType::I64,
        (&[4], DType::I64),
        |e| matches!(e, BoxingError::MixedPartial { .. }),
    );
    let pl = cpu(&[4], &[0, 1, 2, 3]);
    boxing_fails(
        (pl.clone(), &[8], Sbp::S(0).into()),
        (pl, &[8, 1], Sbp::B.into()),
        DType::F32,
        (&[2], DType::F32),
        |e| matches!(e, BoxingError::ShapeMismatch { .. }),
    );
}

#[test]
fn piece_not_matching_the_plan() {
    let pl = cpu(&[4], &[0, 1, 2, 3]);
    // Every rank hands a piece of the wrong dtype (i64 for an f32 plan).
    boxing_fails(
        (pl.clone(), &[8], Sbp::P.into()),
        (pl.clone(), &[8], Sbp::B.into()),
        DType::F32,
        (&[8], DType::I64),
        |e| matches!(e, BoxingError::DTypeMismatch { .. }),
    );
    // Every rank hands the full shape where the layout gives it a slice.
    boxing_fails(
        (pl.clone(), &[8], Sbp::S(0).into()),
        (pl.clone(), &[8], Sbp::B.into()),
        DType::F32,
        (&[8], DType::F32),
        |e| matches!(e, BoxingError::LocalShape { .. }),
    );
    // A cuda placement cannot be boxed with host pieces.
    let gpu = pl.with_device(oxiflow_placement::DeviceType::Cuda);
    boxing_fails(
        (pl, &[8], Sbp::S(0).into()),
        (gpu, &[8], Sbp::B.into()),
        DType::F32,
        (&[2], DType::F32),
        |e| matches!(e, BoxingError::UnsupportedDevice { .. }),
    );
}

#[test]
fn harness_detects_wrong_values() {
    let pl = cpu(&[2], &[0, 1]);
    let shape = Shape::from([4, 2]);
    let global: Vec<f64> = (0..8).map(f64::from).collect();
    let layout = GlobalLayout::new(shape.clone(), &pl, Sbp::B).unwrap();
    let mut pieces = make_pieces(&layout, &global, DType::F64, &mut SplitMix(1));
    assert_eq!(reassemble(&layout, &pieces).unwrap(), global);
    if let Some(HostData::F64(v)) = pieces.get_mut(&1).map(|p| &mut p.data) {
        v[3] += 1.0;
    }
    assert!(reassemble(&layout, &pieces)
        .unwrap_err()
        .contains("disagree"));
    let p = GlobalLayout::new(shape, &pl, Sbp::P).unwrap();
    let pieces = make_pieces(&p, &global, DType::F64, &mut SplitMix(2));
    assert_ne!(pieces[&0], pieces[&1]);
    assert_eq!(reassemble(&p, &pieces).unwrap(), global);
    let _ = Placement::range(oxiflow_placement::DeviceType::Cpu, 1);
}
