//! The executor: validates a rank's piece against a plan (before any communication), then runs
//! the plan's steps on it through the communicator's sub-groups.

use oxiflow_collectives::trace::{trace_end, trace_start, Lane};
use oxiflow_collectives::SharedComm;
use oxiflow_dtype::DType;
use oxiflow_sbp::{GlobalLayout, ReduceOp};

use crate::comm::{member_indices, sub_comm};
use crate::piece::LocalPiece;
use crate::plan::Plan;
use crate::step::{Step, StepKind};
use crate::strategy::{
    all_gather, all_reduce, all_to_all, device_copy, group_region, local_slice, p2p_intersections,
    partial_zero, reduce_scatter, AxisCtx,
};
use crate::{BoxingError, BoxingPlanner};

/// Maps a partial reduction to the communicator's reduce op.
/// Opens the one-way channels of `pairs` (world ranks, sender first) that this rank belongs
/// to, in ascending pair order. Every rank opening from the same list (e.g. every pair some
/// plans of a pipeline step use, `Plan::one_way_pairs`) meets its peers in one order, so the
/// openings (each waits for its peer) cannot wait in a cycle, and the step's transfers then
/// open nothing while others are queued.
pub fn open_one_way(world: &SharedComm, pairs: &[(usize, usize)]) -> Result<(), BoxingError> {
    let me = world.world_ranks()[world.rank()];
    let mut pairs = pairs.to_vec();
    pairs.sort_unstable();
    pairs.dedup();
    for (a, b) in pairs
        .into_iter()
        .filter(|&(a, b)| a != b && (a == me || b == me))
    {
        let m = member_indices(world, &[a, b]).map_err(|rank| BoxingError::RankOutsideWorld {
            from: format!("rank {a}"),
            to: format!("rank {b}"),
            placement: format!("[{a}, {b}]"),
            rank,
            world: world.world_ranks().to_vec(),
        })?;
        world
            .one_way(m[0], m[1])
            .map_err(|source| BoxingError::Comm {
                step: format!("opening the one-way channel {a} -> {b}"),
                source,
            })?;
    }
    Ok(())
}

/// Checks everything about `plan`, `world` and this rank's piece that can be checked without
/// communicating. Placement checks give the same answer on every rank.
pub fn check<P: LocalPiece>(
    plan: &Plan,
    world: &SharedComm,
    piece: Option<&P>,
) -> Result<usize, BoxingError> {
    let (from, to) = (&plan.from, &plan.to);
    for pl in [from.placement(), to.placement()] {
        if let Err(rank) = member_indices(world, pl.ranks()) {
            return Err(BoxingError::RankOutsideWorld {
                from: from.to_string(),
                to: to.to_string(),
                placement: pl.to_string(),
                rank,
                world: world.world_ranks().to_vec(),
            });
        }
    }
    for dev in [from.placement().device(), to.placement().device()] {
        if !P::supports_device(dev) {
            return Err(BoxingError::UnsupportedDevice {
                op: format!("boxing {from} -> {to}"),
                device: dev.to_string(),
            });
        }
    }
    let me = world
        .world_ranks()
        .get(world.rank())
        .copied()
        .unwrap_or(world.rank());
    let piece_err = |detail: String| BoxingError::Piece {
        from: from.to_string(),
        to: to.to_string(),
        rank: me,
        detail,
    };
    match (from.local_shape(me), piece) {
        (None, None) => {}
        (None, Some(_)) => {
            return Err(piece_err(format!(
                "rank is outside {} but was given a piece",
                from.placement()
            )))
        }
        (Some(_), None) => {
            return Err(piece_err(format!(
                "rank is in {} but was given no piece",
                from.placement()
            )))
        }
        (Some(expected), Some(p)) => {
            if p.dtype() != plan.dtype {
                return Err(BoxingError::DTypeMismatch {
                    from: from.to_string(),
                    to: to.to_string(),
                    rank: me,
                    expected: plan.dtype,
                    got: p.dtype(),
                });
            }
            if *p.shape() != expected {
                return Err(BoxingError::LocalShape {
                    from: from.to_string(),
                    to: to.to_string(),
                    rank: me,
                    expected: expected.to_string(),
                    got: p.shape().to_string(),
                });
            }
            if p.device() != from.placement().device() {
                return Err(piece_err(format!(
                    "piece lives on {}, the placement on {}",
                    p.device(),
                    from.placement().device()
                )));
            }
        }
    }
    Ok(me)
}

/// Runs `plan` on this rank's piece (None for ranks outside the source placement). Returns the
/// target piece, None for ranks outside the target placement.
pub fn execute<P: LocalPiece>(
    plan: &Plan,
    world: &SharedComm,
    piece: Option<P>,
) -> Result<Option<P>, BoxingError> {
    let me = check(plan, world, piece.as_ref())?;
    let wide = sums_half_more_than_once(plan);
    let dtype = if wide { DType::F32 } else { plan.dtype };
    let mut piece = match piece {
        Some(p) if wide => Some(p.to_dtype(dtype)?),
        p => p,
    };
    for step in &plan.steps {
        let traced = trace_start();
        piece = run_step(step, world, me, dtype, piece)?;
        trace_end(
            traced,
            Lane::Boxing,
            || step.describe().into(),
            || {
                vec![
                    ("bytes_max", step.bytes_max.into()),
                    ("bytes_total", step.bytes_total.into()),
                    ("from", plan.from.to_string().into()),
                    ("to", plan.to.to_string().into()),
                ]
            },
        );
    }
    match piece {
        Some(p) if wide => p.to_dtype(plan.dtype).map(Some),
        p => Ok(p),
    }
}

/// Whether `plan` sums 16-bit partial values in more than one place: in several collective
/// steps, or at a receiver adding several senders' values. Such a plan runs on f32 copies and
/// rounds once at the end, so the result is the f32 sum rounded once (a single collective
/// sum rounds once by itself: the communicator reduces 16-bit data in f32).
fn sums_half_more_than_once(plan: &Plan) -> bool {
    let sum = Some(ReduceOp::Sum);
    let sums = plan.steps.iter().map(|s| match &s.kind {
        StepKind::AllReduce { op } | StepKind::ReduceScatter { op, .. } => {
            usize::from(Some(*op) == sum)
        }
        StepKind::P2p(p) => 2 * usize::from(p.reduce == sum),
        _ => 0,
    });
    plan.dtype.is_half() && sums.sum::<usize>() > 1
}

/// Plans (through the cache) and executes in one call.
pub fn boxing<P: LocalPiece>(
    planner: &BoxingPlanner,
    world: &SharedComm,
    from: &GlobalLayout,
    to: &GlobalLayout,
    dtype: DType,
    piece: Option<P>,
) -> Result<Option<P>, BoxingError> {
    let plan = planner.plan(from, to, dtype)?;
    execute(&plan, world, piece)
}

fn run_step<P: LocalPiece>(
    step: &Step,
    world: &SharedComm,
    me: usize,
    dtype: DType,
    piece: Option<P>,
) -> Result<Option<P>, BoxingError> {
    match &step.kind {
        StepKind::P2p(p) => return p2p_intersections::run(p, step, world, me, dtype, piece),
        StepKind::DeviceCopy { to, .. } => return device_copy::run(*to, piece),
        StepKind::Relabel => return Ok(piece),
        _ => {}
    }
    let Some(piece) = piece else {
        return Ok(None);
    };
    let (Some(axis), Some((from_sbp, _))) = (step.axis, step.axis_sbps()) else {
        return Err(BoxingError::Local {
            op: step.describe(),
            detail: "per-axis step without an axis".into(),
        });
    };
    let placement = step.before.placement();
    let coord = placement.coord_of(me).ok_or_else(|| BoxingError::Local {
        op: step.describe(),
        detail: format!("rank {me} holds a piece but is outside {placement}"),
    })?;
    let communicates = !matches!(
        step.kind,
        StepKind::LocalSlice { .. } | StepKind::PartialZero { .. }
    );
    let comm = if communicates {
        let group = placement.axis_group_of(me, axis)?.unwrap_or_default();
        Some(sub_comm(world, &group, step)?)
    } else {
        None
    };
    let ctx = AxisCtx::new(
        comm,
        coord[axis],
        placement.shape()[axis],
        &group_region(&step.before, axis, &coord),
    );
    let out = match step.kind {
        StepKind::AllGather { dim } => all_gather::run(&ctx, step, dim, piece)?,
        StepKind::AllReduce { op } => all_reduce::run(&ctx, step, op, piece)?,
        StepKind::ReduceScatter { dim, op } => reduce_scatter::run(&ctx, step, dim, op, piece)?,
        StepKind::AllToAll { from_dim, to_dim } => {
            all_to_all::run(&ctx, step, from_dim, to_dim, piece)?
        }
        StepKind::LocalSlice { dim } => local_slice::run(&ctx, dim, piece)?,
        StepKind::PartialZero { op } => partial_zero::run(&ctx, from_sbp, op, piece)?,
        StepKind::P2p(_) | StepKind::DeviceCopy { .. } | StepKind::Relabel => piece,
    };
    Ok(Some(out))
}
