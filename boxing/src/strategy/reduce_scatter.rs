//! P -> S(d) on a mesh axis: reduce-scatter(-v) of the group tensor into this member's part;
//! the send side is packed part by part first unless dim d is outermost.

use oxiflow_sbp::ReduceOp;

use crate::comm::{comm_err, comm_op};
use crate::piece::LocalPiece;
use crate::region::outer;
use crate::step::Step;
use crate::strategy::AxisCtx;
use crate::BoxingError;

pub(crate) fn run<P: LocalPiece>(
    ctx: &AxisCtx,
    step: &Step,
    dim: usize,
    op: ReduceOp,
    piece: P,
) -> Result<P, BoxingError> {
    let g = &ctx.group_shape;
    let sp = ctx.split(dim);
    let counts = ctx.counts(dim);
    let (dtype, dev) = (piece.dtype(), piece.device());
    let comm = ctx.comm()?;
    let mut out = P::alloc(&g.with_dim(dim, sp.size(ctx.me)), dtype, dev)?;
    if outer(g, dim) == 1 {
        comm.reduce_scatter_v(
            dtype,
            piece.as_buf(),
            out.as_buf_mut(),
            &counts,
            comm_op(op),
        )
        .map_err(comm_err(step))?;
        return Ok(out);
    }
    let boxes: Vec<_> = (0..ctx.p).map(|i| ctx.part_box(g, dim, i)).collect();
    let refs: Vec<&[std::ops::Range<usize>]> = boxes.iter().map(|b| b.as_slice()).collect();
    let mut staging = P::scratch(g.numel(), dtype, dev)?;
    piece.pack(&refs, &mut staging, 0)?;
    drop(piece);
    comm.reduce_scatter_v(
        dtype,
        staging.as_buf(),
        out.as_buf_mut(),
        &counts,
        comm_op(op),
    )
    .map_err(comm_err(step))?;
    staging.recycle();
    Ok(out)
}
