//! Gradient buckets: the partial sums of several global tensors over one mesh axis reduced by
//! one collective. Each rank copies its pieces into one flat buffer on its group of that axis
//! (a 1-d placement), boxes it once (P -> B, an all-reduce; or P -> S(0) of a `[group, C]`
//! buffer, a reduce-scatter whose row `i` holds member `i`'s shards) and cuts the result back
//! into pieces of the tensors' new layouts (on devices, views sharing the result's memory). The buffer may move as another float dtype (`wire`,
//! e.g. bf16 for f32 gradients: half the bytes, each rank's part rounded once before the sum and
//! the result converted back). On NCCL worlds the boxing runs on the
//! communicator's stream and leaves its end event on the result's block, so compute waits only
//! where it next reads a reduced gradient: [`start_bucket`] queues the collective and
//! [`PendingBucket::finish`] cuts the result, so work queued between them overlaps it.

use std::borrow::Cow;

use oxiflow_collectives::trace::{trace_end, trace_start, Lane};
use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceOp, Sbp};

use crate::{Context, Result, Tensor, TensorError};

/// What a bucket's tensors become on the reduced mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BucketTarget {
    /// `B`: every member holds the sum (all-reduce).
    Broadcast,
    /// `S(0)`: each member holds its rows of the sum (reduce-scatter).
    Shard,
}

impl BucketTarget {
    fn sbp(self) -> Sbp {
        match self {
            BucketTarget::Broadcast => Sbp::B,
            BucketTarget::Shard => Sbp::S(0),
        }
    }
}

const OP: &str = "reduce_bucket";

fn bucket_err(detail: String) -> TensorError {
    TensorError::Mismatch { op: OP, detail }
}

/// Whether `g` can join a bucket reduced over `axis` to `target` (see [`reduce_bucket`]'s
/// conditions; a shard that is not a row range of the piece needs boxing of its own, e.g. a
/// tensor also split on dim 0 on an earlier mesh axis). Pure: no communication.
pub fn bucket_fits(g: &Tensor, axis: usize, target: BucketTarget) -> bool {
    targets(std::slice::from_ref(g), axis, target).is_ok()
}

/// The rows `to` gives the member at `at` of the group of `axis`, as a range of the rows of
/// the piece `from` gives at `coord` (None when that shard is not such a row range).
pub(crate) fn shard_rows(
    from: &GlobalLayout,
    to: &GlobalLayout,
    coord: &[usize],
    at: &[usize],
) -> Option<std::ops::Range<usize>> {
    let have = from.region_at(coord);
    let want = to.region_at(at);
    let fits = have.iter().zip(&want).skip(1).all(|(h, w)| h == w)
        && want.first()?.start >= have.first()?.start
        && want.first()?.end <= have.first()?.end;
    fits.then(|| want[0].start - have[0].start..want[0].end - have[0].start)
}

/// `t`'s layout when it may share a bucket with `first`: global, of `first`'s dtype and
/// placement; otherwise the error `err` makes of why.
pub(crate) fn member_layout<'t>(
    t: &'t Tensor,
    first: &Tensor,
    err: fn(String) -> TensorError,
) -> Result<&'t GlobalLayout> {
    let Some(layout) = t.layout() else {
        return Err(err(format!("{} is not global", t.describe())));
    };
    if t.dtype() != first.dtype() || t.placement() != first.placement() {
        return Err(err(format!(
            "{} and {} differ in dtype or placement",
            first.describe(),
            t.describe()
        )));
    }
    Ok(layout)
}

/// Ends the trace span `traced` (if any) of the bucket collective `name` over `tensors`, with
/// how many they are and the bytes of this rank's pieces.
pub(crate) fn trace_bucket(traced: Option<u64>, name: &'static str, tensors: &[Tensor]) {
    trace_end(
        traced,
        Lane::Boxing,
        || Cow::Borrowed(name),
        || {
            let bytes: usize = tensors
                .iter()
                .map(|t| t.to_local().numel() * t.dtype().size())
                .sum();
            vec![
                ("tensors", tensors.len().into()),
                ("local_bytes", bytes.into()),
            ]
        },
    );
}

/// `Ok` when `holds` at every coordinate of `layout`'s placement, so every rank of it reaches
/// one verdict; otherwise the error `err` makes of why: the shards of `t` on mesh axis `axis`
/// are not row ranges of `whole` (the pieces they cut).
pub(crate) fn row_ranges_at_every_coord(
    layout: &GlobalLayout,
    holds: impl Fn(&[usize]) -> bool,
    err: fn(String) -> TensorError,
    (t, axis, whole): (&Tensor, usize, &str),
) -> Result<()> {
    let mesh = layout.placement();
    if (0..mesh.num_ranks()).all(|idx| holds(&mesh.coord_of_index(idx))) {
        return Ok(());
    }
    Err(err(format!(
        "the shards of {} on mesh axis {axis} are not row ranges of {whole}",
        t.describe()
    )))
}

/// The layout of each tensor after the reduction, checked before any communication: every
/// tensor global, on one placement, of one dtype, `P(sum)` on `axis`; a shard target needs a
/// dim 0, and at every coordinate each member's shard must be a row range of the piece.
fn targets(grads: &[Tensor], axis: usize, target: BucketTarget) -> Result<Vec<GlobalLayout>> {
    let Some(first) = grads.first() else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(grads.len());
    for g in grads {
        let layout = member_layout(g, first, bucket_err)?;
        if layout.nd_sbp().as_slice().get(axis) != Some(&Sbp::Partial(ReduceOp::Sum)) {
            return Err(bucket_err(format!(
                "{} is not a partial sum on mesh axis {axis}",
                g.describe()
            )));
        }
        if target == BucketTarget::Shard && g.ndim() == 0 {
            return Err(bucket_err(format!(
                "{} has no dim 0 to shard",
                g.describe()
            )));
        }
        let to = layout
            .with_nd_sbp(layout.nd_sbp().with_axis(axis, target.sbp()))
            .map_err(|e| bucket_err(format!("{}: {e}", g.describe())))?;
        if target == BucketTarget::Shard {
            let members = layout.placement().shape()[axis];
            row_ranges_at_every_coord(
                layout,
                |coord| {
                    (0..members).all(|m| {
                        let mut at = coord.to_vec();
                        at[axis] = m;
                        shard_rows(layout, &to, coord, &at).is_some()
                    })
                },
                bucket_err,
                (g, axis, "its pieces"),
            )?;
        }
        out.push(to);
    }
    Ok(out)
}

/// Reduces the partial sums `grads` over mesh `axis` with one collective per rank group of
/// that axis and returns them laid out with `axis` made `target` (the other axes unchanged),
/// in their own dtype. With `wire`, the collective moves the buffer converted to that float
/// dtype (each rank's part rounded once; the collective sums in it) and the result is
/// converted back. Every rank of the tensors' placement must call it with the same tensors
/// in the same order and the same `wire`. [`start_bucket`] and [`PendingBucket::finish`] in one.
pub fn reduce_bucket(
    grads: &[Tensor],
    axis: usize,
    target: BucketTarget,
    wire: Option<DType>,
) -> Result<Vec<Tensor>> {
    start_bucket(grads, axis, target, wire)?.finish()
}

/// A bucket whose collective is queued ([`start_bucket`]); [`PendingBucket::finish`] cuts the
/// result into the tensors' new pieces. On devices the collective runs on the communicator's
/// stream and the compute stream waits for it only in `finish`, so work queued between the
/// two overlaps it.
pub struct PendingBucket(Pending);

enum Pending {
    /// Nothing left to do (no collective was needed).
    Done(Vec<Tensor>),
    Queued {
        /// This rank's part of the reduced flat buffer (in the wire dtype).
        reduced: Tensor,
        /// The tensors' dtype, and their layouts after the reduction.
        own: DType,
        tos: Vec<GlobalLayout>,
        coord: Vec<usize>,
        ctx: Context,
    },
}

impl PendingBucket {
    /// The reduced tensors, in the order given to [`start_bucket`].
    pub fn finish(self) -> Result<Vec<Tensor>> {
        let (reduced, own, tos, coord, ctx) = match self.0 {
            Pending::Done(out) => return Ok(out),
            Pending::Queued {
                reduced,
                own,
                tos,
                coord,
                ctx,
            } => (reduced, own, tos, coord, ctx),
        };
        let _ctx = ctx.install();
        let _ng = crate::no_grad();
        cut_pieces(&reduced.to_dtype(own)?, tos, &coord, &ctx)
    }
}

/// The tensors laid out `tos` whose pieces at `coord` lie one after another in the flat
/// buffer `flat` (in their dtype): each piece is a view of the buffer's elements where the
/// backend shares memory (devices: no copy; a capture records the views), else a copy.
pub(crate) fn cut_pieces(
    flat: &Tensor,
    tos: Vec<GlobalLayout>,
    coord: &[usize],
    ctx: &Context,
) -> Result<Vec<Tensor>> {
    let mine = match flat.ndim() {
        1 => flat.clone(),
        _ => flat.reshape([flat.numel()])?,
    };
    let mut at = 0;
    let mut out = Vec::with_capacity(tos.len());
    for to in tos {
        let shape = to.local_shape_at(coord);
        let n = shape.numel();
        let piece = mine.elements(at, n)?.reshape(shape)?.0.piece.clone();
        at += n;
        out.push(Tensor::global_from_shared(
            piece,
            to,
            mine.dtype(),
            ctx.clone(),
        ));
    }
    Ok(out)
}

/// Queues the reduction of [`reduce_bucket`] (same arguments, same checks before any
/// communication) and returns it pending: `finish` gives the tensors.
pub fn start_bucket(
    grads: &[Tensor],
    axis: usize,
    target: BucketTarget,
    wire: Option<DType>,
) -> Result<PendingBucket> {
    let tos = targets(grads, axis, target)?;
    if let (Some(w), Some(g)) = (wire, grads.first()) {
        if !w.is_float() || !g.dtype().is_float() {
            return Err(bucket_err(format!(
                "gradients of {} cannot move as {w}: both must be float dtypes",
                g.dtype()
            )));
        }
    }
    let traced = trace_start();
    let out = start_checked(grads, axis, target, tos, wire)?;
    let name = match target {
        BucketTarget::Broadcast => "gradient bucket all-reduce",
        BucketTarget::Shard => "gradient bucket reduce-scatter",
    };
    trace_bucket(traced, name, grads);
    Ok(PendingBucket(out))
}

/// `start_bucket` once `targets` has checked the tensors.
fn start_checked(
    grads: &[Tensor],
    axis: usize,
    target: BucketTarget,
    tos: Vec<GlobalLayout>,
    wire: Option<DType>,
) -> Result<Pending> {
    let (Some(first), Some(ctx)) = (grads.first(), grads.first().and_then(Tensor::context)) else {
        return Ok(Pending::Done(grads.to_vec()));
    };
    let Some(placement) = first.placement() else {
        return Ok(Pending::Done(grads.to_vec()));
    };
    let _ctx = ctx.install();
    let _ng = crate::no_grad();
    let rank = ctx.rank();
    let placement_err =
        |e: oxiflow_placement::PlacementError| bucket_err(format!("placement {placement}: {e}"));
    let (Some(group), Some(coord)) = (
        placement.axis_group_of(rank, axis).map_err(placement_err)?,
        placement.coord_of(rank),
    ) else {
        return Ok(Pending::Done(grads.to_vec()));
    };
    if group.len() == 1 {
        // Nothing to sum: each tensor is relabelled (no copy, no collective).
        return grads
            .iter()
            .zip(tos)
            .map(|(g, to)| g.to_global(placement, to.nd_sbp().clone()))
            .collect::<Result<_>>()
            .map(Pending::Done);
    }
    let sub = Placement::new_1d(placement.device(), group.clone()).map_err(placement_err)?;
    let flats: Vec<Tensor> = grads
        .iter()
        .map(|g| g.to_local().reshape([g.to_local().numel()]))
        .collect::<Result<_>>()?;
    let partial = NdSbp::new([Sbp::Partial(ReduceOp::Sum)]);
    let own = first.dtype();
    let moved = wire.unwrap_or(own);
    let reduced = match target {
        BucketTarget::Broadcast => {
            let flat = concat(&flats)?.to_dtype(moved)?;
            flat.to_global(&sub, partial)?
                .to_global(&sub, NdSbp::broadcast(1))?
                .to_local()
        }
        BucketTarget::Shard => {
            let chunks = (0..group.len())
                .map(|m| member_parts(grads, &flats, &tos, &coord, axis, m))
                .collect::<Result<Vec<_>>>()?;
            let width = chunks
                .iter()
                .map(|c| c.iter().map(Tensor::numel).sum::<usize>())
                .max();
            let width = width.unwrap_or(0);
            let mut parts = Vec::new();
            for mut c in chunks {
                // Padding sums into columns no member reads.
                let pad = width - c.iter().map(Tensor::numel).sum::<usize>();
                if pad > 0 {
                    c.push(padding(&flats, pad, &sub)?);
                }
                parts.extend(c);
            }
            if parts.is_empty() {
                parts.extend(flats.first().map(|f| f.narrow(0, 0, 0)).transpose()?);
            }
            // This rank's rows `[group, width]` in one copy, its own row after the collective
            // (flattened in `finish`).
            concat(&parts)?
                .reshape([group.len(), width])?
                .to_dtype(moved)?
                .to_global(&sub, partial)?
                .to_global(&sub, NdSbp::new([Sbp::S(0)]))?
                .to_local()
        }
    };
    Ok(Pending::Queued {
        reduced,
        own,
        tos,
        coord,
        ctx: ctx.clone(),
    })
}

/// One tensor, or the concatenation of several, along dim 0.
pub(crate) fn concat(flats: &[Tensor]) -> Result<Tensor> {
    match flats {
        [one] => Ok(one.clone()),
        _ => {
            let refs: Vec<&Tensor> = flats.iter().collect();
            Tensor::concat(&refs, 0)
        }
    }
}

/// `n` elements to pad a row of a bucket with (read by no member): the first elements of a
/// flat piece long enough, else zeros, on `sub`'s device.
pub(crate) fn padding(flats: &[Tensor], n: usize, sub: &Placement) -> Result<Tensor> {
    if let Some(long) = flats.iter().find(|f| f.numel() >= n) {
        return long.elements(0, n);
    }
    let dtype = flats.first().map_or(DType::F32, Tensor::dtype);
    let members = sub.num_ranks();
    Ok(Tensor::zeros_global([members * n], dtype, sub, NdSbp::new([Sbp::S(0)]))?.to_local())
}

/// The elements of this rank's flat pieces that member `m` of the group keeps after the
/// reduce-scatter, in order: for each tensor, the rows of its piece in `m`'s shard (views of
/// the pieces where the backend can, see [`Tensor::elements`]).
fn member_parts(
    grads: &[Tensor],
    flats: &[Tensor],
    tos: &[GlobalLayout],
    coord: &[usize],
    axis: usize,
    m: usize,
) -> Result<Vec<Tensor>> {
    let mut at = coord.to_vec();
    at[axis] = m;
    let mut parts = Vec::with_capacity(grads.len());
    for ((g, flat), to) in grads.iter().zip(flats).zip(tos) {
        let (Some(from), local) = (g.layout(), g.to_local()) else {
            return Err(bucket_err(format!("{} is not global", g.describe())));
        };
        let Some(rows) = shard_rows(from, to, coord, &at) else {
            return Err(bucket_err(format!(
                "the shard of {} on mesh axis {axis} is not a row range of its piece",
                g.describe()
            )));
        };
        let row = local.shape().dims().iter().skip(1).product::<usize>();
        if !rows.is_empty() && row > 0 {
            parts.push(flat.elements(rows.start * row, rows.len() * row)?);
        }
    }
    Ok(parts)
}
