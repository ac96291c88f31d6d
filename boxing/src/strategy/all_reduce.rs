//! P -> B on a mesh axis: all-reduce of the piece, in place.

use oxiflow_sbp::ReduceOp;

use crate::execute::{comm_err, comm_op};
use crate::piece::LocalPiece;
use crate::plan::Step;
use crate::strategy::AxisCtx;
use crate::BoxingError;

pub(crate) fn run<P: LocalPiece>(
    ctx: &AxisCtx,
    step: &Step,
    op: ReduceOp,
    mut piece: P,
) -> Result<P, BoxingError> {
    let dtype = piece.dtype();
    ctx.comm()?
        .all_reduce(dtype, piece.as_buf_mut(), comm_op(op))
        .map_err(comm_err(step))?;
    Ok(piece)
}
