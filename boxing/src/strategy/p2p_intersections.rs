//! The general strategy: move slice intersections point to point, for different placements
//! (overlapping or disjoint rank sets, 1 <-> n ranks, other mesh shapes) and as the fallback on
//! one placement. Runs as one all-to-all-v on the communicator of the union of both rank sets:
//! each rank packs what it sends to each destination in plan order; receivers unpack, reducing
//! the contributions of the source's P components. B copies: one source per region, the
//! receiver itself when it holds one. Target P(sum) axes: the rank at coordinate 0 on every
//! such axis holds the value, the others zeros; target P(max)/P(min) axes hold copies.
//! Between disjoint placements (pipeline stages) the exchange is one-way: each sender posts one
//! point-to-point message per receiver on the pair's one-way channel (`Communicator::one_way`:
//! buffered on host backends; on NCCL a communicator and stream per direction, so a send
//! waits behind nothing but earlier sends of the same pair) and goes on; each receiver takes
//! its messages in member order. The send buffer is dropped after the call: its memory is
//! reused only once the send ended, and nothing waits for that.

use std::collections::BTreeMap;
use std::ops::Range;

use oxiflow_collectives::{CommError, Communicator};
use oxiflow_dtype::DType;
use oxiflow_sbp::{GlobalLayout, ReduceOp, Region, Sbp};
use rustc_hash::FxHashMap;

use crate::comm::{comm_err, comm_op, member_indices, sub_comm};
use crate::piece::{Fill, LocalPiece};
use crate::region::{intersect, numel, relative};
use crate::step::{partial_op, P2pPlan, RankIo, Step, StepKind, Transfer};
use crate::BoxingError;

/// Whether the target rank at `coord` holds the value: coordinate 0 on every P(sum) axis.
pub(crate) fn value_holder(layout: &GlobalLayout, coord: &[usize]) -> bool {
    layout
        .nd_sbp()
        .iter()
        .enumerate()
        .all(|(a, s)| s != Sbp::Partial(ReduceOp::Sum) || coord[a] == 0)
}

pub(crate) fn plan_p2p(from: &GlobalLayout, to: &GlobalLayout, dtype: DType) -> Step {
    let (fp, tp) = (from.placement(), to.placement());
    let fnd = from.nd_sbp();
    // Source ranks grouped by (P coordinates, S coordinates); B coordinates vary in a group.
    let mut tiles: BTreeMap<(Vec<usize>, Vec<usize>), Vec<usize>> = BTreeMap::new();
    for idx in 0..fp.num_ranks() {
        let coord = fp.coord_of_index(idx);
        // The coordinates on the axes whose SBP is `kind`.
        let coords_where = |kind: fn(Sbp) -> bool| -> Vec<usize> {
            fnd.iter()
                .zip(&coord)
                .filter(|(s, _)| kind(*s))
                .map(|(_, &c)| c)
                .collect()
        };
        let (pk, sk) = (coords_where(Sbp::is_partial), coords_where(Sbp::is_split));
        tiles.entry((pk, sk)).or_default().push(fp.ranks()[idx]);
    }
    let first_pk = tiles.keys().next().map(|k| k.0.clone()).unwrap_or_default();
    let src_regions: Vec<(usize, Region)> = fp
        .ranks()
        .iter()
        .map(|&r| (r, from.region_of(r).unwrap_or_default()))
        .collect();
    let region_of_src = |r: usize| -> &Region {
        // Every candidate comes from fp, so the lookup succeeds.
        &src_regions[fp.index_of(r).unwrap_or(0)].1
    };

    let mut transfers = Vec::new();
    for (ti, &t) in tp.ranks().iter().enumerate() {
        let coord = tp.coord_of_index(ti);
        if !value_holder(to, &coord) {
            continue;
        }
        let rt = to.region_at(&coord);
        if numel(&rt) == 0 {
            continue;
        }
        for ((pk, _), cands) in &tiles {
            let src = if cands.contains(&t) {
                t
            } else {
                cands[ti % cands.len()]
            };
            if let Some(region) = intersect(region_of_src(src), &rt) {
                transfers.push(Transfer {
                    src,
                    dst: t,
                    region,
                    accumulate: *pk != first_pk,
                });
            }
        }
    }
    let es = dtype.size() as u64;
    let mut recv: BTreeMap<usize, u64> = BTreeMap::new();
    for t in transfers.iter().filter(|t| t.src != t.dst) {
        *recv.entry(t.dst).or_default() += numel(&t.region) as u64 * es;
    }
    let mut union: Vec<usize> = fp.ranks().iter().chain(tp.ranks()).copied().collect();
    union.sort_unstable();
    union.dedup();
    let needs_comm = transfers.iter().any(|t| t.src != t.dst);
    let member = |r: usize| union.binary_search(&r).unwrap_or(usize::MAX);
    let mut io: FxHashMap<usize, RankIo> = FxHashMap::default();
    for (k, t) in transfers.iter().enumerate().filter(|(_, t)| t.src != t.dst) {
        io.entry(t.src).or_default().sends.push(k);
        io.entry(t.dst).or_default().recvs.push(k);
    }
    for r in io.values_mut() {
        // Stable sorts keep plan order within one peer.
        r.sends.sort_by_key(|&k| member(transfers[k].dst));
        r.recvs.sort_by_key(|&k| member(transfers[k].src));
    }
    Step {
        kind: StepKind::P2p(Box::new(P2pPlan {
            union: union.clone(),
            transfers,
            reduce: partial_op(fnd).ok().flatten(),
            needs_comm,
            io,
        })),
        axis: None,
        groups: vec![union],
        before: from.clone(),
        after: to.clone(),
        bytes_max: recv.values().copied().max().unwrap_or(0),
        bytes_total: recv.values().sum(),
    }
}

/// Whether a point-to-point step runs one-way: its placements share no rank.
pub(crate) fn is_one_way(step: &Step) -> bool {
    let to = step.after.placement();
    !step
        .before
        .placement()
        .ranks()
        .iter()
        .any(|&r| to.contains(r))
}

impl P2pPlan {
    /// The (sender, receiver) world-rank pairs whose channels a one-way run of this plan uses.
    pub fn one_way_pairs(&self) -> Vec<(usize, usize)> {
        let mut pairs: Vec<(usize, usize)> = self
            .transfers
            .iter()
            .filter(|t| t.src != t.dst)
            .map(|t| (t.src, t.dst))
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        pairs
    }
}

/// Runs a point-to-point step on world rank `me`; returns the target piece (None when `me` is
/// not in the target placement).
pub(crate) fn run<P: LocalPiece>(
    plan: &P2pPlan,
    step: &Step,
    world: &oxiflow_collectives::SharedComm,
    me: usize,
    dtype: DType,
    piece: Option<P>,
) -> Result<Option<P>, BoxingError> {
    let Ok(my_member) = plan.union.binary_search(&me) else {
        return Ok(None);
    };
    let (from, to) = (&step.before, &step.after);
    let dev = to.placement().device();
    let src_dev = from.placement().device();
    let my_src_region = from.region_of(me);
    let mut recv_offsets: Vec<usize> = vec![usize::MAX; plan.transfers.len()];
    let mut staging_recv = None;
    if plan.needs_comm {
        let n = plan.union.len();
        let mut send_counts = vec![0usize; n];
        let mut recv_counts = vec![0usize; n];
        let empty = RankIo::default();
        let io = plan.io.get(&me).unwrap_or(&empty);
        let mut send_boxes: Vec<Region> = Vec::with_capacity(io.sends.len());
        for &k in &io.sends {
            let t = &plan.transfers[k];
            let origin = my_src_region.as_ref().ok_or_else(|| missing(step, me))?;
            send_boxes.push(relative(&t.region, origin));
            send_counts[plan.union.binary_search(&t.dst).unwrap_or(0)] += numel(&t.region);
        }
        let mut at = 0;
        for &k in &io.recvs {
            let t = &plan.transfers[k];
            recv_offsets[k] = at;
            at += numel(&t.region);
            recv_counts[plan.union.binary_search(&t.src).unwrap_or(0)] += numel(&t.region);
        }
        let total_send: usize = send_counts.iter().sum();
        let mut send = P::scratch(total_send, dtype, src_dev)?;
        if total_send > 0 {
            let src = piece.as_ref().ok_or_else(|| missing(step, me))?;
            let refs: Vec<&[Range<usize>]> = send_boxes.iter().map(|b| b.as_slice()).collect();
            src.pack(&refs, &mut send, 0)?;
        }
        let mut recv = P::scratch(at, dtype, src_dev)?;
        if is_one_way(step) {
            let members = member_indices(world, &plan.union).map_err(|rank| {
                BoxingError::RankOutsideWorld {
                    from: from.to_string(),
                    to: to.to_string(),
                    placement: from.placement().to_string(),
                    rank,
                    world: world.world_ranks().to_vec(),
                }
            })?;
            let counts = (&send_counts[..], &recv_counts[..]);
            exchange_one_way(
                &**world, &members, my_member, dtype, &send, &mut recv, counts,
            )
            .map_err(comm_err(step))?;
        } else {
            let comm = sub_comm(world, &plan.union, step)?;
            debug_assert_eq!(comm.rank(), my_member);
            comm.all_to_all_v(
                dtype,
                send.as_buf(),
                &send_counts,
                recv.as_buf_mut(),
                &recv_counts,
            )
            .map_err(comm_err(step))?;
        }
        send.recycle();
        staging_recv = Some(recv);
    }
    let _ = my_member;
    let Some(coord) = to.placement().coord_of(me) else {
        return Ok(None);
    };
    let out_shape = to.local_shape_at(&coord);
    if !value_holder(to, &coord) {
        return P::filled(&out_shape, dtype, dev, Fill::Zero).map(Some);
    }
    let my_dst_region = to.region_at(&coord);
    let mut out = P::alloc(&out_shape, dtype, dev)?;
    let op = plan.reduce.map(comm_op);
    for (k, t) in plan.transfers.iter().enumerate() {
        if t.dst != me {
            continue;
        }
        let at = relative(&t.region, &my_dst_region);
        let red = if t.accumulate { op } else { None };
        if t.src == me {
            let src = piece.as_ref().ok_or_else(|| missing(step, me))?;
            let origin = my_src_region.as_ref().ok_or_else(|| missing(step, me))?;
            out.copy_box(&at, src, &relative(&t.region, origin), red)?;
        } else {
            let recv = staging_recv.as_ref().ok_or_else(|| missing(step, me))?;
            out.unpack(&[&at], recv, recv_offsets[k], red)?;
        }
    }
    if let Some(r) = staging_recv {
        r.recycle();
    }
    Ok(Some(out))
}

/// The data of an all-to-all-v between disjoint placements, where every rank only sends or
/// only receives: one point-to-point message per peer with data (in member order), each on
/// the one-way channel from its sender to its receiver (`members`: the world member of each
/// union member; `me`: this rank's union member). A sender goes on without waiting for its
/// receivers; a receive waits (within the communicator's timeout) on host backends and is
/// queued on the channel's stream on devices.
fn exchange_one_way<P: LocalPiece>(
    world: &dyn Communicator,
    members: &[usize],
    me: usize,
    dtype: DType,
    send: &P,
    recv: &mut P,
    (send_counts, recv_counts): (&[usize], &[usize]),
) -> Result<(), CommError> {
    let es = dtype.size();
    let outside = |what: &str, r: &Range<usize>, len: usize| CommError::InvalidArgument {
        op: "one-way exchange".into(),
        detail: format!(
            "{what} bytes {}..{} outside a buffer of {len}",
            r.start, r.end
        ),
    };
    let buf = send.as_buf();
    for (peer, r) in peer_ranges(send_counts, es) {
        let part = buf
            .slice(r.clone())
            .ok_or_else(|| outside("send", &r, buf.len_bytes()))?;
        world
            .one_way(members[me], members[peer])?
            .send(dtype, part, 1)?;
    }
    let mut buf = recv.as_buf_mut();
    let len = buf.len_bytes();
    for (peer, r) in peer_ranges(recv_counts, es) {
        let part = buf
            .slice_mut(r.clone())
            .ok_or_else(|| outside("receive", &r, len))?;
        world
            .one_way(members[peer], members[me])?
            .recv(dtype, part, 0)?;
    }
    Ok(())
}

/// The peers with data in a buffer holding `counts[peer]` elements of `es` bytes for each peer
/// in order, with the byte range of each one's part.
fn peer_ranges(counts: &[usize], es: usize) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    let mut at = 0;
    counts.iter().enumerate().filter_map(move |(peer, &n)| {
        let range = at..at + n * es;
        at = range.end;
        (n > 0).then_some((peer, range))
    })
}

fn missing(step: &Step, me: usize) -> BoxingError {
    BoxingError::Piece {
        from: step.before.to_string(),
        to: step.after.to_string(),
        rank: me,
        detail: "the plan has this rank send data but it holds no source piece".into(),
    }
}
