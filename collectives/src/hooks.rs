//! `BackendHooks`: what a backend implements. The public `Communicator` methods (`boundary.rs`)
//! check every argument once and then call these hooks, which may rely on the checks: counts
//! have one entry per member and sum without overflow, buffers hold exactly the elements the
//! counts say, roots and peers are members, sub-group members are distinct members including
//! this one, and buffers are in the backend's memory (`Read`/`Write`).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::flight::CommLog;
use crate::strided::pack;
use crate::{Backend, Buf, BufMut, CommError, DType, ReduceOp, SharedComm, StridedBlock};

/// The unchecked collectives of one backend (see the module docs for what holds on entry).
pub(crate) trait BackendHooks: Send + Sync + 'static {
    /// A buffer the backend reads, in its memory (host bytes or a device pointer).
    type Read<'a>: Copy;
    /// A buffer the backend writes.
    type Write<'a>;

    fn rank(&self) -> usize;
    fn backend(&self) -> Backend;
    /// This communicator's flight-recorder group and call counter.
    fn log(&self) -> &CommLog;
    /// The members' world ranks, in member order: the log's group.
    fn world_ranks(&self) -> &[usize] {
        self.log().group()
    }

    /// `b` as this backend's memory, or `Unsupported`/`InvalidArgument` for another kind.
    fn read<'a>(&self, op: &str, what: &str, b: Buf<'a>) -> Result<Self::Read<'a>, CommError>;
    fn write<'a>(&self, op: &str, what: &str, b: BufMut<'a>) -> Result<Self::Write<'a>, CommError>;

    /// Whether the reductions reduce 16-bit floats themselves; otherwise the public methods
    /// run them as f32 reductions (`widen.rs`) and the hooks never see a 16-bit reduction.
    fn reduces_half(&self) -> bool {
        false
    }
    /// `buf` holds `count` elements.
    fn all_reduce(
        &self,
        dtype: DType,
        buf: Self::Write<'_>,
        count: usize,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// `send` and `recv` hold `count` elements each.
    fn all_reduce_into(
        &self,
        dtype: DType,
        send: Self::Read<'_>,
        recv: Self::Write<'_>,
        count: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let _ = (dtype, send, recv, count, op);
        Err(self.unsupported("all_reduce_into"))
    }
    /// `send` holds `counts[rank]` elements, `recv` their sum `total`.
    fn all_gather_v(
        &self,
        dtype: DType,
        send: Self::Read<'_>,
        recv: Self::Write<'_>,
        counts: &[usize],
        total: usize,
    ) -> Result<(), CommError>;
    /// `send` holds `total` elements, `recv` `counts[rank]`.
    fn reduce_scatter_v(
        &self,
        dtype: DType,
        send: Self::Read<'_>,
        recv: Self::Write<'_>,
        counts: &[usize],
        total: usize,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Buffers match their counts; `send_counts[rank] == recv_counts[rank]`.
    fn all_to_all_v(
        &self,
        dtype: DType,
        send: Self::Read<'_>,
        send_counts: &[usize],
        recv: Self::Write<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError>;
    /// `send` holds every part but the own one; otherwise as `all_to_all_v`.
    fn all_to_all_v_others(
        &self,
        dtype: DType,
        send: Self::Read<'_>,
        send_counts: &[usize],
        recv: Self::Write<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let _ = (dtype, send, send_counts, recv, recv_counts);
        Err(self.unsupported("all_to_all_v_others"))
    }
    /// `send_layout` lies inside `send`; `send_counts[j]` is block j's element count.
    #[allow(clippy::too_many_arguments)]
    fn all_to_all_v_strided(
        &self,
        dtype: DType,
        send: Self::Read<'_>,
        send_layout: &[StridedBlock],
        send_counts: &[usize],
        recv: Self::Write<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let _ = (dtype, send, send_layout, send_counts, recv, recv_counts);
        Err(CommError::Unsupported {
            op: "all_to_all_v_strided".into(),
            backend: self.backend().to_string(),
            detail: "strided device buffers; pack them and call all_to_all_v".into(),
        })
    }
    /// `root` is a member; `buf` holds whole elements.
    fn broadcast(&self, dtype: DType, buf: Self::Write<'_>, root: usize) -> Result<(), CommError>;
    /// `root` is a member; `buf` holds `count` elements.
    fn reduce(
        &self,
        dtype: DType,
        buf: Self::Write<'_>,
        count: usize,
        root: usize,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// `peer` is a member; `buf` holds whole elements.
    fn send(&self, dtype: DType, buf: Self::Read<'_>, peer: usize) -> Result<(), CommError>;
    fn recv(&self, dtype: DType, buf: Self::Write<'_>, peer: usize) -> Result<(), CommError>;
    fn barrier(&self) -> Result<(), CommError>;
    /// `members` are distinct members; this one is member `me` of them.
    fn sub_group(&self, members: &[usize], me: usize) -> Result<SharedComm, CommError>;
    /// `from` and `to` are distinct members, this one is member `me` (0: `from`, 1: `to`) of
    /// the pair. Host backends buffer their sends, so the sub-group of the pair (in that order)
    /// serves.
    fn one_way(&self, from: usize, to: usize, me: usize) -> Result<SharedComm, CommError> {
        self.sub_group(&[from, to], me)
    }

    fn unsupported(&self, op: &str) -> CommError {
        CommError::Unsupported {
            op: op.to_string(),
            backend: self.backend().to_string(),
            detail: "not implemented by this backend".into(),
        }
    }
}

/// Backends over host memory share these implementations of the derived calls.
pub(crate) trait HostHooks:
    for<'a> BackendHooks<Read<'a> = &'a [u8], Write<'a> = &'a mut [u8]>
{
}

impl<T> HostHooks for T where T: for<'a> BackendHooks<Read<'a> = &'a [u8], Write<'a> = &'a mut [u8]> {}

/// Items of a `BackendHooks` impl that every host-memory backend writes alike, by name:
/// `host_hooks!(identity: BACKEND)` (the rank, backend and log of a communicator with `me`
/// and `log` fields), `host_hooks!(buffers: BACKEND)` (the buffer types and their
/// conversion), and
/// `host_hooks!(all_reduce_into)`, `host_hooks!(all_to_all_v_others)`,
/// `host_hooks!(all_to_all_v_strided)` (the derived calls through the shared host functions).
macro_rules! host_hooks {
    (identity: $backend:expr) => {
        fn rank(&self) -> usize {
            self.me
        }
        fn backend(&self) -> Backend {
            $backend
        }
        fn log(&self) -> &CommLog {
            &self.log
        }
    };
    (buffers: $backend:expr) => {
        type Read<'a> = &'a [u8];
        type Write<'a> = &'a mut [u8];
        fn read<'a>(&self, op: &str, what: &str, b: Buf<'a>) -> Result<&'a [u8], CommError> {
            $crate::hooks::host_read($backend, op, what, b)
        }
        fn write<'a>(
            &self,
            op: &str,
            what: &str,
            b: BufMut<'a>,
        ) -> Result<&'a mut [u8], CommError> {
            $crate::hooks::host_write($backend, op, what, b)
        }
    };
    (all_reduce_into) => {
        fn all_reduce_into(
            &self,
            dtype: DType,
            send: &[u8],
            recv: &mut [u8],
            count: usize,
            op: ReduceOp,
        ) -> Result<(), CommError> {
            $crate::hooks::host_all_reduce_into(self, dtype, send, recv, count, op)
        }
    };
    (all_to_all_v_others) => {
        fn all_to_all_v_others(
            &self,
            dtype: DType,
            send: &[u8],
            send_counts: &[usize],
            recv: &mut [u8],
            recv_counts: &[usize],
        ) -> Result<(), CommError> {
            let (sc, rc) = (send_counts, recv_counts);
            $crate::hooks::host_all_to_all_v_others(self, dtype, send, sc, recv, rc)
        }
    };
    (all_to_all_v_strided) => {
        fn all_to_all_v_strided(
            &self,
            dtype: DType,
            send: &[u8],
            send_layout: &[StridedBlock],
            send_counts: &[usize],
            recv: &mut [u8],
            recv_counts: &[usize],
        ) -> Result<(), CommError> {
            let (layout, counts) = (send_layout, send_counts);
            $crate::hooks::host_all_to_all_v_strided(
                self,
                dtype,
                send,
                layout,
                counts,
                recv,
                recv_counts,
            )
        }
    };
}
pub(crate) use host_hooks;

/// The sub-communicator of `members` (indices into `world`, the communicator's world ranks):
/// from `subs` (the sub-communicators made so far, by member list) when made before, else made by `make` from the members' world ranks and kept
/// there (`subs` stays locked meanwhile).
pub(crate) fn cached_sub_group(
    subs: &Mutex<HashMap<Vec<usize>, SharedComm>>,
    members: &[usize],
    world: &[usize],
    make: impl FnOnce(Vec<usize>) -> Result<SharedComm, CommError>,
) -> Result<SharedComm, CommError> {
    let mut subs = subs.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = subs.get(members) {
        return Ok(c.clone());
    }
    let comm = make(members.iter().map(|&m| world[m]).collect())?;
    subs.insert(members.to_vec(), comm.clone());
    Ok(comm)
}

/// Host memory of a read buffer (`Unsupported` for device memory).
pub(crate) fn host_read<'a>(
    backend: Backend,
    op: &str,
    what: &str,
    b: Buf<'a>,
) -> Result<&'a [u8], CommError> {
    match b {
        Buf::Host(s) => Ok(s),
        Buf::Device(d) => Err(device_buffer(backend, op, what, d.bytes, d.device)),
    }
}

/// Host memory of a write buffer (`Unsupported` for device memory).
pub(crate) fn host_write<'a>(
    backend: Backend,
    op: &str,
    what: &str,
    b: BufMut<'a>,
) -> Result<&'a mut [u8], CommError> {
    match b {
        BufMut::Host(s) => Ok(s),
        BufMut::Device(d) => Err(device_buffer(backend, op, what, d.bytes, d.device)),
    }
}

/// `Unsupported`: buffer `what` of `op` is device memory, which `backend` does not take.
fn device_buffer(
    backend: Backend,
    op: &str,
    what: &str,
    bytes: usize,
    device: impl std::fmt::Display,
) -> CommError {
    CommError::Unsupported {
        op: op.to_string(),
        backend: backend.to_string(),
        detail: format!(
            "{what} is a device buffer ({bytes} bytes on device {device}); host buffers only"
        ),
    }
}

/// Out-of-place all-reduce as a copy and an in-place one.
pub(crate) fn host_all_reduce_into<B: HostHooks>(
    b: &B,
    dtype: DType,
    send: &[u8],
    recv: &mut [u8],
    count: usize,
    op: ReduceOp,
) -> Result<(), CommError> {
    recv.copy_from_slice(send);
    b.all_reduce(dtype, recv, count, op)
}

/// All-to-all without the own part: rebuilds the full send buffer (the own part is taken
/// from its place in `recv`) and runs `all_to_all_v`.
pub(crate) fn host_all_to_all_v_others<B: HostHooks>(
    b: &B,
    dtype: DType,
    send: &[u8],
    send_counts: &[usize],
    recv: &mut [u8],
    recv_counts: &[usize],
) -> Result<(), CommError> {
    let (me, esz) = (b.rank(), dtype.size());
    let before: usize = send_counts[..me].iter().sum::<usize>() * esz;
    let own = send_counts[me] * esz;
    let r_own: usize = recv_counts[..me].iter().sum::<usize>() * esz;
    let mut full = Vec::with_capacity(send.len() + own);
    full.extend_from_slice(&send[..before]);
    full.extend_from_slice(&recv[r_own..r_own + own]);
    full.extend_from_slice(&send[before..]);
    b.all_to_all_v(dtype, &full, send_counts, recv, recv_counts)
}

/// Strided all-to-all by packing into a scratch buffer.
pub(crate) fn host_all_to_all_v_strided<B: HostHooks>(
    b: &B,
    dtype: DType,
    send: &[u8],
    send_layout: &[StridedBlock],
    send_counts: &[usize],
    recv: &mut [u8],
    recv_counts: &[usize],
) -> Result<(), CommError> {
    let packed = pack(send, send_layout, dtype);
    b.all_to_all_v(dtype, &packed, send_counts, recv, recv_counts)
}
