//! The peers of an op call: the ranks of the placement whose pieces of one input differ only in
//! their range of one dim (the ranks of the mesh axes that split that dim), in mesh order, with
//! the channel between them. What [`LocalAt::peers_along`](super::LocalAt::peers_along) gives an
//! op whose kernel exchanges pieces with other ranks (a ring over a split sequence); a call on
//! local tensors, or an input that no mesh axis splits on the dim, has a group of one.

use std::fmt;
use std::ops::Range;

use oxiflow_collectives::{Buf, BufMut, DevicePtr, SharedComm};
use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::{GlobalLayout, NdSbp, Sbp, Shape};

use crate::element::TensorElement;
use crate::{Result, TensorError};

/// One rank's exchange group (see the module docs).
#[derive(Clone)]
pub struct Peers {
    /// The group's communicator; None for a group of one.
    comm: Option<SharedComm>,
    me: usize,
    regions: Vec<Range<usize>>,
}

impl fmt::Debug for Peers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Peers(member {} of {:?})", self.me, self.regions)
    }
}

impl Peers {
    /// The group of one holding `len` indices of the dim (a local call, or no split).
    pub fn alone(len: usize) -> Peers {
        Peers {
            comm: None,
            me: 0,
            regions: std::iter::once(0..len).collect(),
        }
    }

    /// The group of `rank` along `dim` of a tensor of `shape` laid out as `nd_sbp` on
    /// `placement` (`world`: the communicator of the placement's ranks' world): the ranks that
    /// differ from `rank` only on the mesh axes splitting `dim` (several axes split it
    /// nested).
    pub(crate) fn along(
        world: &SharedComm,
        rank: usize,
        shape: &Shape,
        placement: &Placement,
        nd_sbp: &NdSbp,
        dim: usize,
    ) -> std::result::Result<Peers, String> {
        // An axis of one rank splits nothing: it holds the whole dim.
        let axes: Vec<usize> = nd_sbp
            .iter()
            .enumerate()
            .filter(|&(a, s)| s == Sbp::Split(dim) && placement.shape().get(a) > Some(&1))
            .map(|(a, _)| a)
            .collect();
        let layout = GlobalLayout::new(shape.clone(), placement, nd_sbp.clone())
            .map_err(|e| e.to_string())?;
        let Some(mine) = layout.region_of(rank) else {
            return Err(format!("rank {rank} is outside {placement}"));
        };
        if axes.is_empty() {
            return Ok(Peers::alone(mine.get(dim).map_or(0, |r| r.len())));
        }
        // The ranks whose coordinates differ from this rank's only on the splitting axes, in
        // mesh order: nested splits give them consecutive ranges of the dim in that order.
        let outside = || format!("rank {rank} is outside {placement}");
        let at = placement.coord_of(rank).ok_or_else(outside)?;
        let members: Vec<usize> = placement
            .ranks()
            .iter()
            .copied()
            .filter(|&r| {
                placement.coord_of(r).is_some_and(|c| {
                    c.iter()
                        .zip(&at)
                        .enumerate()
                        .all(|(a, (x, y))| x == y || axes.contains(&a))
                })
            })
            .collect();
        let me = members.iter().position(|&r| r == rank).unwrap_or(0);
        let mut regions = Vec::with_capacity(members.len());
        for &r in &members {
            let region = layout
                .region_of(r)
                .ok_or_else(|| format!("rank {r} is outside {placement}"))?;
            regions.push(region.get(dim).cloned().unwrap_or(0..0));
        }
        let comm = match members.len() {
            1 => None,
            _ => Some(
                world
                    .sub_group(&members)
                    .map_err(|e| format!("the group of ranks {members:?}: {e}"))?,
            ),
        };
        Ok(Peers { comm, me, regions })
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether the group is this rank alone (never empty).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// This rank's member index.
    pub fn me(&self) -> usize {
        self.me
    }

    /// Each member's global index range of the dim, in member order.
    pub fn regions(&self) -> &[Range<usize>] {
        &self.regions
    }

    /// One step of a ring: sends `send` to the next member and fills `recv` from the previous
    /// one (member 0 receives first, the others send first, so a rendezvous send cannot wait in
    /// a circle). A group of one copies `send` into `recv`. Errors name `op`.
    pub fn shift<T: TensorElement + bytemuck::Pod>(
        &self,
        op: &'static str,
        send: &[T],
        recv: &mut [T],
    ) -> Result<()> {
        let Some(comm) = &self.comm else {
            if send.len() != recv.len() {
                return Err(TensorError::Kernel {
                    op,
                    detail: format!("shifts {} elements into {}", send.len(), recv.len()),
                });
            }
            recv.copy_from_slice(send);
            return Ok(());
        };
        let n = self.len();
        let (next, prev) = ((self.me + 1) % n, (self.me + n - 1) % n);
        let err = |source| TensorError::Comm { op, source };
        let to_next = || comm.send(T::DTYPE, Buf::Host(bytemuck::cast_slice(send)), next);
        if self.me != 0 {
            to_next().map_err(err)?;
        }
        comm.recv(T::DTYPE, BufMut::Host(bytemuck::cast_slice_mut(recv)), prev)
            .map_err(err)?;
        if self.me == 0 {
            to_next().map_err(err)?;
        }
        Ok(())
    }

    /// One step of a ring on device memory: `send` (elements of `dtype`) goes to the next
    /// member while `recv` fills from the previous one, both directions in one grouped call (no
    /// member order can wait in a circle). Buffers carrying a fence get the call's end event
    /// instead of the caller's stream waiting for it, so the exchange overlaps later kernels. A
    /// group of one has nobody to exchange with: a typed error (its caller keeps its own block).
    /// Errors name `op`.
    pub fn shift_device(
        &self,
        op: &'static str,
        dtype: DType,
        send: DevicePtr<'_>,
        recv: DevicePtr<'_>,
    ) -> Result<()> {
        let n = self.len();
        let (next, prev) = ((self.me + 1) % n, (self.me + n - 1) % n);
        let (mut send_counts, mut recv_counts) = (vec![0; n], vec![0; n]);
        send_counts[next] = send.bytes / dtype.size();
        recv_counts[prev] = recv.bytes / dtype.size();
        self.all_to_all_v_device(op, dtype, (send, &send_counts), (recv, &recv_counts))
    }

    /// An all-to-all-v on device memory: `send` holds `counts[j]` elements of `dtype` for member
    /// j, in member order, and `recv` receives its `counts[i]` from member i, in member order,
    /// as one grouped call. Fences as in [`Peers::shift_device`]; a group of one is a typed
    /// error. Errors name `op`.
    pub fn all_to_all_v_device(
        &self,
        op: &'static str,
        dtype: DType,
        (send, send_counts): (DevicePtr<'_>, &[usize]),
        (recv, recv_counts): (DevicePtr<'_>, &[usize]),
    ) -> Result<()> {
        let Some(comm) = &self.comm else {
            return Err(TensorError::Kernel {
                op,
                detail: "a group of one has nobody to exchange device memory with".into(),
            });
        };
        comm.all_to_all_v(
            dtype,
            Buf::Device(send),
            send_counts,
            BufMut::Device(recv),
            recv_counts,
        )
        .map_err(|source| TensorError::Comm { op, source })
    }

    /// An all-to-all whose receive counts are data: `send` holds `counts[j]` elements for
    /// member j, in member order; returns what every member sent this one (in member order)
    /// and how many elements each sent. The counts travel first, so the members need not know
    /// them. A group of one keeps `send`. Errors name `op`.
    pub fn all_to_all_v<T: TensorElement + bytemuck::Pod>(
        &self,
        op: &'static str,
        send: &[T],
        counts: &[usize],
    ) -> Result<(Vec<T>, Vec<usize>)> {
        let Some(comm) = &self.comm else {
            if counts.len() != 1 || counts[0] != send.len() {
                return Err(TensorError::Kernel {
                    op,
                    detail: format!("sends {counts:?} of {} elements to itself", send.len()),
                });
            }
            return Ok((send.to_vec(), counts.to_vec()));
        };
        let (recv, recv_counts) = comm
            .all_to_all_v_exchanged(T::DTYPE, bytemuck::cast_slice(send), counts)
            .map_err(|source| TensorError::Comm { op, source })?;
        let mut out = vec![T::zeroed(); recv_counts.iter().sum()];
        let bytes = bytemuck::cast_slice_mut::<T, u8>(&mut out);
        if bytes.len() != recv.len() {
            return Err(TensorError::Kernel {
                op,
                detail: format!(
                    "received {} bytes for {recv_counts:?} elements of {}",
                    recv.len(),
                    T::DTYPE
                ),
            });
        }
        bytes.copy_from_slice(&recv);
        Ok((out, recv_counts))
    }
}
