//! S(a) -> S(b) on a mesh axis: all-to-all(-v). Member i sends member j the part j of dim b of
//! its piece and receives part i of dim b of member j's piece, placed at part j of dim a. Send
//! is direct when dim b is outermost in the piece; else host pieces go through the strided
//! all-to-all (each part is runs at a constant stride, which the CPU backend sends without
//! packing) and device pieces are packed (the own part then goes straight into the result when
//! the receive is direct). Receive is direct when dim a is outermost in the result (else
//! unpacked from staging).

use std::ops::Range;

use oxiflow_collectives::{Buf, BufMut, StridedBlock};

use crate::comm::comm_err;
use crate::piece::LocalPiece;
use crate::region::{numel, outer};
use crate::step::Step;
use crate::strategy::AxisCtx;
use crate::BoxingError;

pub(crate) fn run<P: LocalPiece>(
    ctx: &AxisCtx,
    step: &Step,
    a: usize,
    b: usize,
    piece: P,
) -> Result<P, BoxingError> {
    let (dtype, dev) = (piece.dtype(), piece.device());
    let in_shape = piece.shape().clone();
    let out_shape = ctx.group_shape.with_dim(b, ctx.split(b).size(ctx.me));
    let send_boxes: Vec<_> = (0..ctx.p).map(|j| ctx.part_box(&in_shape, b, j)).collect();
    let recv_boxes: Vec<_> = (0..ctx.p).map(|j| ctx.part_box(&out_shape, a, j)).collect();
    let send_counts: Vec<usize> = send_boxes.iter().map(|r| numel(r)).collect();
    let recv_counts: Vec<usize> = recv_boxes.iter().map(|r| numel(r)).collect();
    let comm = ctx.comm()?;

    // Host pieces whose send parts are strided go out through the strided all-to-all (the
    // CPU backend copies the runs without packing); device pieces are packed here.
    let strided = outer(&in_shape, b) > 1 && matches!(piece.as_buf(), Buf::Host(_));
    let layout: Vec<StridedBlock> = if strided {
        let inner: usize = in_shape.dims()[b + 1..].iter().product();
        let split = ctx.split(b);
        (0..ctx.p)
            .map(|j| {
                let r = split.range(j);
                StridedBlock {
                    offset: r.start * inner,
                    run_len: r.len() * inner,
                    stride: in_shape.dim(b) * inner,
                    runs: outer(&in_shape, b),
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    // Device pieces with a direct receive: the other members' parts are packed and sent, and
    // the own part goes straight from the piece into its place in the result (no pack and no
    // self-transfer for it).
    if !strided && outer(&in_shape, b) > 1 && outer(&out_shape, a) == 1 {
        let me = ctx.me;
        let others: Vec<&[Range<usize>]> = (0..ctx.p)
            .filter(|&j| j != me)
            .map(|j| send_boxes[j].as_slice())
            .collect();
        let mut s = P::scratch(in_shape.numel() - send_counts[me], dtype, dev)?;
        piece.pack(&others, &mut s, 0)?;
        let mut out = P::alloc(&out_shape, dtype, dev)?;
        let own_at: usize = recv_counts[..me].iter().sum();
        piece.pack(&[send_boxes[me].as_slice()], &mut out, own_at)?;
        comm.all_to_all_v_others(
            dtype,
            s.as_buf(),
            &send_counts,
            out.as_buf_mut(),
            &recv_counts,
        )
        .map_err(comm_err(step))?;
        s.recycle();
        return Ok(out);
    }
    let packed = if outer(&in_shape, b) == 1 || strided {
        None
    } else {
        let refs: Vec<&[Range<usize>]> = send_boxes.iter().map(|r| r.as_slice()).collect();
        let mut s = P::scratch(in_shape.numel(), dtype, dev)?;
        piece.pack(&refs, &mut s, 0)?;
        Some(s)
    };
    let send_piece = packed.as_ref().unwrap_or(&piece);
    let exchange = |recv: BufMut<'_>| {
        if strided {
            comm.all_to_all_v_strided(dtype, piece.as_buf(), &layout, recv, &recv_counts)
        } else {
            comm.all_to_all_v(dtype, send_piece.as_buf(), &send_counts, recv, &recv_counts)
        }
        .map_err(comm_err(step))
    };
    let mut out = P::alloc(&out_shape, dtype, dev)?;
    if outer(&out_shape, a) == 1 {
        exchange(out.as_buf_mut())?;
    } else {
        let mut staging = P::scratch(out_shape.numel(), dtype, dev)?;
        exchange(staging.as_buf_mut())?;
        let refs: Vec<&[Range<usize>]> = recv_boxes.iter().map(|r| r.as_slice()).collect();
        out.unpack(&refs, &staging, 0, None)?;
        staging.recycle();
    }
    if let Some(s) = packed {
        s.recycle();
    }
    Ok(out)
}
