//! The `Communicator` interface: the collectives every backend (threads, TCP, NCCL) provides.

use std::fmt;
use std::sync::Arc;

use crate::{Buf, BufMut, CommError, DType, ReduceOp, StridedBlock};

/// Which implementation runs the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Ranks are threads of one process.
    InProcess,
    /// Ranks are processes on one or many hosts; TCP data plane (shared memory on one host).
    Cpu,
    /// NCCL on CUDA devices.
    Nccl,
    /// MPI processes (feature `mpi`), host memory.
    Mpi,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::InProcess => "in-process",
            Backend::Cpu => "cpu",
            Backend::Nccl => "nccl",
            Backend::Mpi => "mpi",
        })
    }
}

/// A shared handle to a communicator.
pub type SharedComm = Arc<dyn Communicator>;

/// A group of ranks that run collectives together.
///
/// Contract, for every backend:
/// - Ranks inside a communicator are `0..size()`; `world_ranks()[i]` is the world rank of
///   member `i`. All counts are in elements of `dtype`; buffer lengths are checked against
///   counts (`CommError::BufferSize`) before anything is sent.
/// - Every argument is checked in one place (`boundary.rs`) before the backend runs, so a bad
///   argument gets the same typed error on every backend, and every call is recorded in the
///   [`flight_recorder`](crate::flight_recorder).
/// - Every member calls the same collectives in the same order (SPMD); a member that does not
///   arrive within the communicator's timeout makes the others fail with
///   `CommError::Timeout`/`PeerLost` naming it. No call blocks forever.
/// - `*_v` variants take per-member counts (zero allowed) and lay pieces out in member order.
/// - Buffers may be host or device memory as the backend supports (`CommError::Unsupported`
///   otherwise); send and receive buffers never alias.
///
/// The trait is sealed: backends implement the crate's unchecked hooks, and this interface is
/// provided for them.
pub trait Communicator: Send + Sync + sealed::Sealed {
    /// This member's index, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of members.
    fn size(&self) -> usize;
    /// World rank of each member, in member order.
    fn world_ranks(&self) -> &[usize];
    fn backend(&self) -> Backend;

    /// In place: every member ends with `op` over all members' buffers.
    fn all_reduce(&self, dtype: DType, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError>;
    /// Out of place: `recv` (as long as `send`) gets `op` over all members' `send`; `send` is
    /// left as it was.
    fn all_reduce_into(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// `recv` = concatenation of every member's `send` (member i contributes `counts[i]`).
    fn all_gather_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        counts: &[usize],
    ) -> Result<(), CommError>;
    /// `send` holds `sum(counts)` elements; member i receives `op` over all members of the
    /// i-th chunk (`counts[i]` elements).
    fn reduce_scatter_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// `send` holds `send_counts[j]` elements for member j, in member order; `recv` receives
    /// `recv_counts[i]` elements from member i, in member order. `send_counts[me]` must equal
    /// `recv_counts[me]`.
    fn all_to_all_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError>;
    /// In place: every member ends with `root`'s buffer.
    fn broadcast(&self, dtype: DType, buf: BufMut<'_>, root: usize) -> Result<(), CommError>;
    /// In place: `root` ends with `op` over all buffers; the others' buffers are unspecified.
    fn reduce(
        &self,
        dtype: DType,
        buf: BufMut<'_>,
        root: usize,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Point to point; matched in order with the peer's `recv`.
    fn send(&self, dtype: DType, buf: Buf<'_>, peer: usize) -> Result<(), CommError>;
    fn recv(&self, dtype: DType, buf: BufMut<'_>, peer: usize) -> Result<(), CommError>;
    fn barrier(&self) -> Result<(), CommError>;
    /// The communicator of `members` (indices into this communicator, distinct, in the order
    /// that becomes the sub-communicator's member order). Called by the members only, all with
    /// the same list; cached, so asking twice is cheap.
    fn sub_group(&self, members: &[usize]) -> Result<SharedComm, CommError>;
    /// The channel for messages from member `from` to member `to` only: a communicator of the
    /// two (`from` is its member 0, `to` its member 1) that carries nothing else, so a send on
    /// it never queues behind traffic of the other direction or of other groups (on NCCL its
    /// own communicator and stream: a device send blocks its stream until the receive is
    /// posted). Called by `from` and `to` only; the first call of a pair waits for the other
    /// (both open it), later ones are cached.
    fn one_way(&self, from: usize, to: usize) -> Result<SharedComm, CommError>;

    /// All-gather with equal counts: `recv.len() == size() * send.len()`.
    fn all_gather(&self, dtype: DType, send: Buf<'_>, recv: BufMut<'_>) -> Result<(), CommError>;
    /// All-to-all-v without the member's own part, which the caller copies locally (e.g. from
    /// a strided piece straight into its place): `send` holds only the parts for the other
    /// members, in member order; `recv` has the full layout of `recv_counts`, and its own
    /// region (`recv_counts[me]` elements after the earlier members') is left as it was.
    /// `send_counts[me]` must equal `recv_counts[me]`. Interoperates with `all_to_all_v`.
    fn all_to_all_v_others(
        &self,
        dtype: DType,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError>;
    /// All-to-all-v whose send pieces need not be contiguous: member j receives the elements
    /// of `send_layout[j]` (runs at a stride, in run order) as if they had been packed into
    /// `send_counts[j] = send_layout[j].count()` consecutive elements; `recv` is as in
    /// `all_to_all_v`. Interoperates with `all_to_all_v` (members may mix the two in one call).
    /// Host backends; device backends answer `Unsupported` (pack and call `all_to_all_v`).
    fn all_to_all_v_strided(
        &self,
        dtype: DType,
        send: Buf<'_>,
        send_layout: &[StridedBlock],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError>;
    /// What each member sends this one when every member sends `send_counts[j]` elements to
    /// member j: entry i is member i's `send_counts[rank()]` (a small all-to-all of the counts,
    /// one per member pair). Every member calls it; host memory, so a device backend answers
    /// `Unsupported`.
    fn exchange_counts(&self, send_counts: &[usize]) -> Result<Vec<usize>, CommError>;
    /// All-to-all-v whose receive counts are data: the counts are exchanged first
    /// ([`exchange_counts`](Communicator::exchange_counts)), then `send` (`send_counts[j]`
    /// elements for member j, in member order) moves by `all_to_all_v`. Returns the received
    /// elements (member i's `recv_counts[i]`, in member order) and `recv_counts`. Host memory.
    fn all_to_all_v_exchanged(
        &self,
        dtype: DType,
        send: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>), CommError>;
    /// Reduce-scatter with equal counts: `send.len() == size() * recv.len()`.
    fn reduce_scatter(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError>;
}

pub(crate) mod sealed {
    /// Only the crate's backends (through `BackendHooks`) are communicators.
    pub trait Sealed {}
}
