//! The collectives a boxing step runs on: reduce ops and errors in their terms, and the
//! communicator of a step's rank group.

use oxiflow_collectives::{CommError, SharedComm};
use oxiflow_sbp::ReduceOp;
use smallvec::SmallVec;

use crate::step::Step;
use crate::BoxingError;

/// The collectives' reduce op of `op`.
pub(crate) fn comm_op(op: ReduceOp) -> oxiflow_collectives::ReduceOp {
    match op {
        ReduceOp::Sum => oxiflow_collectives::ReduceOp::Sum,
        ReduceOp::Max => oxiflow_collectives::ReduceOp::Max,
        ReduceOp::Min => oxiflow_collectives::ReduceOp::Min,
    }
}

pub(crate) fn comm_err(step: &Step) -> impl FnOnce(CommError) -> BoxingError + '_ {
    move |source| BoxingError::Comm {
        step: step.describe(),
        source,
    }
}

/// Member index in `world` of each world rank, or the rank that is missing.
pub(crate) fn member_indices(
    world: &SharedComm,
    ranks: &[usize],
) -> Result<SmallVec<[usize; 16]>, usize> {
    let wr = world.world_ranks();
    let identity = wr.iter().enumerate().all(|(i, &r)| i == r);
    ranks
        .iter()
        .map(|&r| {
            if identity {
                (r < wr.len()).then_some(r).ok_or(r)
            } else {
                wr.iter().position(|&x| x == r).ok_or(r)
            }
        })
        .collect()
}

/// The communicator of `ranks` (world ranks, in that member order); `world` itself when equal.
pub(crate) fn sub_comm(
    world: &SharedComm,
    ranks: &[usize],
    step: &Step,
) -> Result<SharedComm, BoxingError> {
    let idx = member_indices(world, ranks).map_err(|rank| BoxingError::RankOutsideWorld {
        from: step.before.to_string(),
        to: step.after.to_string(),
        placement: step.before.placement().to_string(),
        rank,
        world: world.world_ranks().to_vec(),
    })?;
    if idx.len() == world.size() && idx.iter().enumerate().all(|(i, &x)| i == x) {
        return Ok(world.clone());
    }
    world.sub_group(&idx).map_err(comm_err(step))
}
