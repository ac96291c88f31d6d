//! Parameter buckets: the shards of several global tensors over one mesh axis gathered by one
//! collective (the write-back of a ZeRO-1/2 update). Each rank copies its shards into one
//! row of a `[group, C]` buffer on its group of that axis (a 1-d placement, row `i` member
//! `i`'s shards one after another, padded to the longest member's), boxes it once (S(0) -> B,
//! an all-gather) and copies each tensor's new piece out of the gathered rows in one
//! multi-range copy, then cuts that buffer into the pieces (on devices, views sharing its
//! memory). The values move as they are: the gathered tensors equal boxing each one alone,
//! bit for bit.

use oxiflow_collectives::trace::trace_start;
use oxiflow_placement::Placement;
use oxiflow_sbp::{GlobalLayout, NdSbp, Sbp};

use crate::bucket::{
    concat, cut_pieces, member_layout, padding, row_ranges_at_every_coord, shard_rows, trace_bucket,
};
use crate::{Result, Tensor, TensorError};

fn bucket_err(detail: String) -> TensorError {
    TensorError::Mismatch {
        op: "gather_bucket",
        detail,
    }
}

/// Whether `shard` can join a bucket gathered over `axis` (see [`gather_bucket`]'s
/// conditions). Pure: no communication.
pub fn gather_fits(shard: &Tensor, axis: usize) -> bool {
    gathered_layouts(std::slice::from_ref(shard), axis).is_ok()
}

/// The rows of the gathered piece at `coord` that each member of the group of `axis` holds
/// (`from` the shards' layout, `to` the gathered one, `members` the group's size), or None
/// unless they are row ranges that tile the piece in member order.
fn member_rows(
    from: &GlobalLayout,
    to: &GlobalLayout,
    coord: &[usize],
    axis: usize,
    members: usize,
) -> Option<Vec<std::ops::Range<usize>>> {
    let mut at = coord.to_vec();
    let mut rows = Vec::with_capacity(members);
    let mut next = 0;
    for m in 0..members {
        at[axis] = m;
        let r = shard_rows(to, from, coord, &at)?;
        if r.start != next {
            return None;
        }
        next = r.end;
        rows.push(r);
    }
    let whole = to.local_shape_at(coord).dims().first().copied()?;
    (next == whole).then_some(rows)
}

/// The layout of each tensor after the gather, checked before any communication: every
/// tensor global, on one placement, of one dtype, with a dim 0 split `S(0)` on `axis`, and at
/// every coordinate each member's piece a row range of the gathered piece.
fn gathered_layouts(shards: &[Tensor], axis: usize) -> Result<Vec<GlobalLayout>> {
    let Some(first) = shards.first() else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(shards.len());
    for s in shards {
        let layout = member_layout(s, first, bucket_err)?;
        if s.ndim() == 0 || layout.nd_sbp().as_slice().get(axis) != Some(&Sbp::S(0)) {
            return Err(bucket_err(format!(
                "{} is not split along dim 0 on mesh axis {axis}",
                s.describe()
            )));
        }
        let to = layout
            .with_nd_sbp(layout.nd_sbp().with_axis(axis, Sbp::B))
            .map_err(|e| bucket_err(format!("{}: {e}", s.describe())))?;
        let members = layout.placement().shape()[axis];
        row_ranges_at_every_coord(
            layout,
            |coord| member_rows(layout, &to, coord, axis, members).is_some(),
            bucket_err,
            (s, axis, "the gathered pieces"),
        )?;
        out.push(to);
    }
    Ok(out)
}

/// Gathers the shards `shards` (each split `S(0)` on mesh `axis`) with one all-gather per rank
/// group of that axis and returns them laid out with `axis` made `B` (the other axes
/// unchanged), bit for bit as boxing each alone gives. Every rank of the tensors' placement
/// must call it with the same tensors in the same order; mixed dtypes or placements, a tensor
/// not split on dim 0 there, or shards that are no row ranges of the gathered pieces are a
/// typed error on every rank before any communication.
pub fn gather_bucket(shards: &[Tensor], axis: usize) -> Result<Vec<Tensor>> {
    let tos = gathered_layouts(shards, axis)?;
    let traced = trace_start();
    let out = gather_checked(shards, axis, tos)?;
    trace_bucket(traced, "parameter bucket all-gather", shards);
    Ok(out)
}

/// `gather_bucket` once `gathered_layouts` has checked the tensors.
fn gather_checked(shards: &[Tensor], axis: usize, tos: Vec<GlobalLayout>) -> Result<Vec<Tensor>> {
    let (Some(first), Some(ctx)) = (shards.first(), shards.first().and_then(Tensor::context))
    else {
        return Ok(shards.to_vec());
    };
    let Some(placement) = first.placement() else {
        return Ok(shards.to_vec());
    };
    let _ctx = ctx.install();
    let _ng = crate::no_grad();
    let rank = ctx.rank();
    let placement_err =
        |e: oxiflow_placement::PlacementError| bucket_err(format!("placement {placement}: {e}"));
    let relabel = || {
        shards
            .iter()
            .zip(&tos)
            .map(|(s, to)| s.to_global(placement, to.nd_sbp().clone()))
            .collect()
    };
    let (Some(group), Some(coord)) = (
        placement.axis_group_of(rank, axis).map_err(placement_err)?,
        placement.coord_of(rank),
    ) else {
        // A rank outside the placement holds no piece: only the layouts change.
        return relabel();
    };
    if group.len() == 1 {
        // One member holds everything: each tensor is relabelled (no copy, no collective).
        return relabel();
    }
    // (offset in the member's row, elements) of each tensor's part, per member.
    let mut parts = vec![Vec::with_capacity(shards.len()); group.len()];
    for (s, to) in shards.iter().zip(&tos) {
        let from = s
            .layout()
            .ok_or_else(|| bucket_err(format!("{} is not global", s.describe())))?;
        let row = to
            .local_shape_at(&coord)
            .dims()
            .iter()
            .skip(1)
            .product::<usize>();
        let rows = member_rows(from, to, &coord, axis, group.len()).ok_or_else(|| {
            bucket_err(format!(
                "the shards of {} on mesh axis {axis} are not row ranges of the gathered piece",
                s.describe()
            ))
        })?;
        for (member, r) in parts.iter_mut().zip(rows) {
            let at = member.last().map_or(0, |&(o, n)| o + n);
            member.push((at, r.len() * row));
        }
    }
    let width = parts
        .iter()
        .map(|p| p.last().map_or(0, |&(o, n)| o + n))
        .max()
        .unwrap_or(0);
    let flats: Vec<Tensor> = shards
        .iter()
        .map(|s| s.to_local().reshape([s.to_local().numel()]))
        .collect::<Result<_>>()?;
    let sub = Placement::new_1d(placement.device(), group.clone()).map_err(placement_err)?;
    // This rank's row in one copy; its padding lands in columns no member reads.
    let mut mine: Vec<Tensor> = flats.iter().filter(|f| f.numel() > 0).cloned().collect();
    let held: usize = mine.iter().map(Tensor::numel).sum();
    if width > held {
        mine.push(padding(&flats, width - held, &sub)?);
    }
    if mine.is_empty() {
        mine.push(flats[0].elements(0, 0)?);
    }
    let gathered = concat(&mine)?
        .reshape([1, width])?
        .to_global(&sub, NdSbp::new([Sbp::S(0)]))?
        .to_global(&sub, NdSbp::broadcast(1))?
        .to_local()
        .reshape([group.len() * width])?;
    // Each tensor's new piece is its members' parts in member order (S(0) orders the rows so),
    // copied out of the gathered rows in one copy.
    let mut views = Vec::with_capacity(shards.len() * group.len());
    for i in 0..shards.len() {
        for (m, member) in parts.iter().enumerate() {
            let (at, n) = member[i];
            if n > 0 {
                views.push(gathered.elements(m * width + at, n)?);
            }
        }
    }
    let out = match views.len() {
        0 => gathered.elements(0, 0)?,
        _ => concat(&views)?,
    };
    cut_pieces(&out, tos, &coord, ctx)
}
