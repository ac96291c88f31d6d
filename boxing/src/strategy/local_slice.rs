//! B -> S(d) on a mesh axis: each member keeps its part of dim d; no communication.

use crate::piece::LocalPiece;
use crate::strategy::AxisCtx;
use crate::BoxingError;

pub(crate) fn run<P: LocalPiece>(ctx: &AxisCtx, dim: usize, piece: P) -> Result<P, BoxingError> {
    let sp = ctx.split(dim);
    if sp.size(ctx.me) == ctx.group_shape.dim(dim) {
        return Ok(piece);
    }
    piece.slice(&ctx.part_box(&ctx.group_shape, dim, ctx.me))
}
