//! P -> B on a mesh axis: all-reduce of the piece, in place, or into a new piece when the
//! piece's memory is shared (a tensor's storage, which must not change).

use oxiflow_sbp::ReduceOp;

use crate::comm::{comm_err, comm_op};
use crate::piece::LocalPiece;
use crate::step::Step;
use crate::strategy::AxisCtx;
use crate::BoxingError;

pub(crate) fn run<P: LocalPiece>(
    ctx: &AxisCtx,
    step: &Step,
    op: ReduceOp,
    mut piece: P,
) -> Result<P, BoxingError> {
    let dtype = piece.dtype();
    let comm = ctx.comm()?;
    if piece.is_shared() {
        let mut out = P::alloc(piece.shape(), dtype, piece.device())?;
        comm.all_reduce_into(dtype, piece.as_buf(), out.as_buf_mut(), comm_op(op))
            .map_err(comm_err(step))?;
        return Ok(out);
    }
    comm.all_reduce(dtype, piece.as_buf_mut(), comm_op(op))
        .map_err(comm_err(step))?;
    Ok(piece)
}
