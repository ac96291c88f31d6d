//! S(d) -> B on a mesh axis: all-gather(-v) of the group tensor. Gathers straight into the
//! result when the parts of dim d are contiguous (d outermost), else into a staging buffer that
//! is then rearranged.

use crate::comm::comm_err;
use crate::piece::LocalPiece;
use crate::region::outer;
use crate::step::Step;
use crate::strategy::AxisCtx;
use crate::BoxingError;

pub(crate) fn run<P: LocalPiece>(
    ctx: &AxisCtx,
    step: &Step,
    dim: usize,
    piece: P,
) -> Result<P, BoxingError> {
    let g = &ctx.group_shape;
    let counts = ctx.counts(dim);
    let (dtype, dev) = (piece.dtype(), piece.device());
    let comm = ctx.comm()?;
    if outer(g, dim) == 1 {
        let mut out = P::alloc(g, dtype, dev)?;
        comm.all_gather_v(dtype, piece.as_buf(), out.as_buf_mut(), &counts)
            .map_err(comm_err(step))?;
        return Ok(out);
    }
    let mut staging = P::scratch(g.numel(), dtype, dev)?;
    comm.all_gather_v(dtype, piece.as_buf(), staging.as_buf_mut(), &counts)
        .map_err(comm_err(step))?;
    drop(piece);
    let boxes: Vec<_> = (0..ctx.p).map(|i| ctx.part_box(g, dim, i)).collect();
    let refs: Vec<&[std::ops::Range<usize>]> = boxes.iter().map(|b| b.as_slice()).collect();
    let mut out = P::alloc(g, dtype, dev)?;
    out.unpack(&refs, &staging, 0, None)?;
    staging.recycle();
    Ok(out)
}
