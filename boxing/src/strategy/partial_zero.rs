//! B -> P and S(d) -> P on a mesh axis, locally: from B, member 0 keeps the value and the others
//! hold zeros (for P(max)/P(min) every member keeps its copy); from S(d), each member holds the
//! identity of the reduction everywhere except its own part.

use oxiflow_sbp::{ReduceOp, Sbp};

use crate::piece::{Fill, LocalPiece};
use crate::strategy::AxisCtx;
use crate::BoxingError;

pub(crate) fn run<P: LocalPiece>(
    ctx: &AxisCtx,
    from: Sbp,
    op: ReduceOp,
    piece: P,
) -> Result<P, BoxingError> {
    let (dtype, dev) = (piece.dtype(), piece.device());
    match from {
        Sbp::Split(d) => {
            let fill = Fill::Identity(crate::comm::comm_op(op));
            let mut out = P::filled(&ctx.group_shape, dtype, dev, fill)?;
            out.write_region(&ctx.part_box(&ctx.group_shape, d, ctx.me), &piece, None)?;
            Ok(out)
        }
        _ if op == ReduceOp::Sum && ctx.me != 0 => P::filled(piece.shape(), dtype, dev, Fill::Zero),
        _ => Ok(piece),
    }
}
