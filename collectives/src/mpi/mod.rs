//! The MPI backend (feature `mpi`): the communicator over an MPI library through rsmpi, for jobs
//! started by `mpirun`/`srun` (`OXIFLOW_BACKEND=mpi`). Host memory; sub-groups are MPI
//! communicators made by their members only (`MPI_Comm_create_group`). Data movement uses
//! rsmpi's safe calls on bytes; reductions call `MPI_Allreduce`/`MPI_Reduce`/
//! `MPI_Reduce_scatter` with the element type. Sends are buffered (a copy, `MPI_Isend`,
//! completed later), so both members of a pair may send before they receive. MPI calls of a
//! world are serialised, and one that outlives the timeout ends the job (see `runtime`).

mod runtime;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use ::mpi::collective::SystemOperation;
use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::ffi;
use ::mpi::raw::AsRaw;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use ::mpi::Count;

use crate::env::LaunchEnv;
use crate::flight::CommLog;
use crate::hooks::{cached_sub_group, host_hooks, BackendHooks};
use crate::{Backend, Buf, BufMut, CommError, DType, ReduceOp, SharedComm, StridedBlock};
pub(crate) use runtime::bootstrap_rendezvous;
use runtime::{ensure_initialized, Watchdog};

const BACKEND: Backend = Backend::Mpi;
/// Tag of point-to-point messages (collectives do not use tags).
const P2P_TAG: i32 = 7;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An MPI communicator handle that may move between threads: every MPI call on it is made
/// under the world's call lock, and MPI runs at thread level `Multiple`.
struct CommHandle(SimpleCommunicator);

// SAFETY: the handle is an opaque MPI object; MPI (thread level Multiple) allows its use from
// any thread, and this crate serialises the calls (`Watchdog::enter`).
unsafe impl Send for CommHandle {}
// SAFETY: as above; shared references only make MPI calls under the call lock.
unsafe impl Sync for CommHandle {}

impl Drop for CommHandle {
    fn drop(&mut self) {
        // A communicator outliving MPI_Finalize (freed at exit) must not be freed again.
        if ::mpi::environment::is_finalized() {
            let world = SimpleCommunicator::world();
            std::mem::forget(std::mem::replace(&mut self.0, world));
        }
    }
}

/// A buffered send in flight: the copy stays alive until MPI reports the send complete.
struct PendingSend {
    _data: Vec<u8>,
    request: ffi::MPI_Request,
}

// SAFETY: the request is an opaque MPI handle, tested only under the call lock.
unsafe impl Send for PendingSend {}

/// This process's member of an MPI group (the world or a sub-group).
pub struct MpiComm {
    watchdog: Arc<Watchdog>,
    comm: CommHandle,
    ranks: Vec<usize>,
    me: usize,
    subs: Mutex<HashMap<Vec<usize>, SharedComm>>,
    sends: Mutex<Vec<PendingSend>>,
    /// The send copy of in-place reductions, kept between calls.
    scratch: Mutex<Vec<u8>>,
    log: CommLog,
}

/// The MPI world of a job started by an MPI launcher: checks that the launch environment
/// describes the same world as `MPI_COMM_WORLD` (rank and size).
pub fn init_world_mpi(env: &LaunchEnv) -> Result<SharedComm, CommError> {
    ensure_initialized()?;
    let world = SimpleCommunicator::world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    if size != env.world_size || rank != env.rank {
        return Err(CommError::Env(format!(
            "OXIFLOW_BACKEND=mpi: the launch environment says rank {} of {} ranks, but \
             MPI_COMM_WORLD has rank {rank} of {size}: start every rank with one launcher \
             (mpirun or srun) and do not set RANK/WORLD_SIZE by hand",
            env.rank, env.world_size
        )));
    }
    let watchdog = Watchdog::start(env.timeout)?;
    Ok(Arc::new(MpiComm::new(
        watchdog,
        world,
        (0..size).collect(),
        rank,
    )))
}

/// An MPI element count: MPI counts are C ints.
fn count(op: &str, what: &str, n: usize) -> Result<Count, CommError> {
    Count::try_from(n).map_err(|_| CommError::InvalidArgument {
        op: op.to_string(),
        detail: format!("{what} of {n} exceeds MPI's count limit ({})", Count::MAX),
    })
}

/// Byte counts and displacements of pieces of `counts` elements each.
fn byte_layout(
    op: &str,
    counts: &[usize],
    dtype: DType,
) -> Result<(Vec<Count>, Vec<Count>), CommError> {
    let mut c = Vec::with_capacity(counts.len());
    let mut d = Vec::with_capacity(counts.len());
    let mut off = 0usize;
    for &k in counts {
        let bytes = k * dtype.size();
        d.push(count(op, "displacement", off)?);
        c.push(count(op, "piece", bytes)?);
        off += bytes;
    }
    Ok((c, d))
}

/// `b`, or an empty slice of `spare` when `b` is empty: the dangling address of an empty Rust
/// slice (1) is Open MPI's `MPI_IN_PLACE`, which would change the call's meaning.
fn placed<'a>(b: &'a [u8], spare: &'a [u8; 1]) -> &'a [u8] {
    if b.is_empty() {
        &spare[..0]
    } else {
        b
    }
}

/// As `placed`, for a buffer MPI writes.
fn placed_mut<'a>(b: &'a mut [u8], spare: &'a mut [u8; 1]) -> &'a mut [u8] {
    if b.is_empty() {
        &mut spare[..0]
    } else {
        b
    }
}

/// An MPI reduction between two buffers (`MPI_Allreduce`, `MPI_Reduce_scatter_block`,
/// `MPI_Reduce_scatter`): send, receive, the count argument, element type, op, communicator.
type MpiReduction<N> = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    N,
    ffi::MPI_Datatype,
    ffi::MPI_Op,
    ffi::MPI_Comm,
) -> i32;

fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    match dtype {
        DType::F32 => f32::equivalent_datatype().as_raw(),
        DType::F64 => f64::equivalent_datatype().as_raw(),
        DType::I64 => i64::equivalent_datatype().as_raw(),
        // 16-bit floats only move here: their reductions arrive widened to f32 (`widen.rs`).
        DType::BF16 | DType::F16 => u16::equivalent_datatype().as_raw(),
    }
}

fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
    match op {
        ReduceOp::Sum => SystemOperation::sum().as_raw(),
        ReduceOp::Max => SystemOperation::max().as_raw(),
        ReduceOp::Min => SystemOperation::min().as_raw(),
    }
}

impl MpiComm {
    fn new(
        watchdog: Arc<Watchdog>,
        comm: SimpleCommunicator,
        ranks: Vec<usize>,
        me: usize,
    ) -> MpiComm {
        MpiComm {
            watchdog,
            comm: CommHandle(comm),
            log: CommLog::new(&ranks),
            ranks,
            me,
            subs: Mutex::new(HashMap::new()),
            sends: Mutex::new(Vec::new()),
            scratch: Mutex::new(Vec::new()),
        }
    }

    fn name(&self, op: &str) -> String {
        format!("{op} on ranks {:?}", self.ranks)
    }

    /// Runs `f`, call `name` of this communicator under its watchdog, on `s` and `r` as
    /// `placed` and `placed_mut` give them.
    fn placed_call<T>(
        &self,
        name: &str,
        s: &[u8],
        r: &mut [u8],
        f: impl FnOnce(&[u8], &mut [u8]) -> T,
    ) -> T {
        let (spare, mut spare_mut) = ([0u8], [0u8]);
        let (s, r) = (placed(s, &spare), placed_mut(r, &mut spare_mut));
        let _call = self.watchdog.enter(|| self.name(name));
        f(s, r)
    }

    fn check(&self, op: &str, call: &str, code: i32) -> Result<(), CommError> {
        if code == 0 {
            return Ok(());
        }
        Err(CommError::Device(format!(
            "{}: {call} returned error code {code}",
            self.name(op)
        )))
    }

    /// The send copy of an in-place reduction of `b`, in the scratch buffer kept between calls.
    fn send_copy(&self, b: &[u8]) -> MutexGuard<'_, Vec<u8>> {
        let mut scratch = lock(&self.scratch);
        scratch.clear();
        scratch.extend_from_slice(b);
        scratch
    }

    /// Runs the MPI reduction `f` (named `call`) from `send` into `recv` with `n` (an element
    /// count, or one count per member) of `dtype` under `op` on this communicator, and checks
    /// its result code under `name`.
    ///
    /// # Safety
    /// `send` and `recv` hold what `n` says `f` reads and writes, and do not overlap.
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduction<N>(
        &self,
        name: &str,
        call: &str,
        f: MpiReduction<N>,
        send: &[u8],
        recv: &mut [u8],
        n: N,
        (dtype, op): (DType, ReduceOp),
    ) -> Result<(), CommError> {
        let (s, r) = (send.as_ptr(), recv.as_mut_ptr());
        // SAFETY: the caller guarantees the buffers match `n`; the call returns when MPI is
        // done with them.
        let code = unsafe {
            f(
                s as *const c_void,
                r as *mut c_void,
                n,
                datatype(dtype),
                mpi_op(op),
                self.comm.0.as_raw(),
            )
        };
        self.check(name, call, code)
    }

    /// Completes the buffered sends MPI has finished (all of them with `wait`).
    fn reap_sends(&self, wait: bool) -> Result<(), CommError> {
        let mut sends = lock(&self.sends);
        let mut i = 0;
        while i < sends.len() {
            let mut done: i32 = 0;
            let code = if wait {
                done = 1;
                // SAFETY: a live request of this communicator; its buffer is still owned here.
                unsafe { ffi::MPI_Wait(&mut sends[i].request, ffi::RSMPI_STATUS_IGNORE) }
            } else {
                // SAFETY: as above; `done` is a valid flag to write.
                unsafe { ffi::MPI_Test(&mut sends[i].request, &mut done, ffi::RSMPI_STATUS_IGNORE) }
            };
            self.check("send", "MPI_Test", code)?;
            if done != 0 {
                sends.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if !::mpi::environment::is_finalized() && !lock(&self.sends).is_empty() {
            let _call = self
                .watchdog
                .enter(|| self.name("send (completing at drop)"));
            if let Err(e) = self.reap_sends(true) {
                tracing::warn!("{e}");
            }
        }
    }
}

impl BackendHooks for MpiComm {
    host_hooks!(buffers: BACKEND);
    host_hooks!(all_to_all_v_others);
    host_hooks!(all_to_all_v_strided);
    host_hooks!(identity: BACKEND);

    fn all_reduce(
        &self,
        dtype: DType,
        b: &mut [u8],
        n: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let send = self.send_copy(b);
        self.all_reduce_into(dtype, &send, b, n, op)
    }

    fn all_reduce_into(
        &self,
        dtype: DType,
        send: &[u8],
        recv: &mut [u8],
        n: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "all_reduce";
        if n == 0 {
            return Ok(());
        }
        let n = count(name, "buffer", n)?;
        let _call = self.watchdog.enter(|| self.name(name));
        // SAFETY: both buffers hold `n` elements of `dtype` (checked at the boundary) and do
        // not overlap.
        unsafe {
            self.reduction(
                name,
                "MPI_Allreduce",
                ffi::MPI_Allreduce,
                send,
                recv,
                n,
                (dtype, op),
            )
        }
    }

    fn all_gather_v(
        &self,
        dtype: DType,
        s: &[u8],
        r: &mut [u8],
        counts: &[usize],
        _total: usize,
    ) -> Result<(), CommError> {
        let name = "all_gather_v";
        let (c, d) = byte_layout(name, counts, dtype)?;
        self.placed_call(name, s, r, |s, r| {
            let mut part = PartitionMut::new(r, c, d);
            self.comm.0.all_gather_varcount_into(s, &mut part);
            Ok(())
        })
    }

    fn reduce_scatter_v(
        &self,
        dtype: DType,
        s: &[u8],
        r: &mut [u8],
        counts: &[usize],
        _total: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "reduce_scatter_v";
        let equal = counts.iter().all(|&c| c == counts[0]);
        let counts: Vec<Count> = counts
            .iter()
            .map(|&c| count(name, "count", c))
            .collect::<Result<_, _>>()?;
        self.placed_call(name, s, r, |s, r| {
            if equal {
                // SAFETY: as below, with every member's chunk `counts[0]` elements long.
                return unsafe {
                    self.reduction(
                        name,
                        "MPI_Reduce_scatter_block",
                        ffi::MPI_Reduce_scatter_block,
                        s,
                        r,
                        counts[0],
                        (dtype, op),
                    )
                };
            }
            // SAFETY: `s` holds sum(counts) and `r` counts[me] elements of `dtype` (checked at
            // the boundary); `counts` has one entry per member; nothing overlaps.
            unsafe {
                self.reduction(
                    name,
                    "MPI_Reduce_scatter",
                    ffi::MPI_Reduce_scatter,
                    s,
                    r,
                    counts.as_ptr(),
                    (dtype, op),
                )
            }
        })
    }

    fn all_to_all_v(
        &self,
        dtype: DType,
        s: &[u8],
        send_counts: &[usize],
        r: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let name = "all_to_all_v";
        let (sc, sd) = byte_layout(name, send_counts, dtype)?;
        let (rc, rd) = byte_layout(name, recv_counts, dtype)?;
        self.placed_call(name, s, r, |s, r| {
            let send = Partition::new(s, sc, sd);
            let mut recv = PartitionMut::new(r, rc, rd);
            self.comm.0.all_to_all_varcount_into(&send, &mut recv);
            Ok(())
        })
    }

    fn broadcast(&self, _dtype: DType, b: &mut [u8], root: usize) -> Result<(), CommError> {
        let name = "broadcast";
        if b.is_empty() {
            return Ok(());
        }
        count(name, "buffer", b.len())?;
        let _call = self.watchdog.enter(|| self.name(name));
        self.comm.0.process_at_rank(root as i32).broadcast_into(b);
        Ok(())
    }

    fn reduce(
        &self,
        dtype: DType,
        b: &mut [u8],
        n: usize,
        root: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "reduce";
        if n == 0 {
            return Ok(());
        }
        let n = count(name, "buffer", n)?;
        let send = self.send_copy(b);
        let recv: *mut c_void = if root == self.me {
            b.as_mut_ptr() as *mut c_void
        } else {
            std::ptr::null_mut()
        };
        let _call = self.watchdog.enter(|| self.name(name));
        // SAFETY: `send` holds `n` elements of `dtype`; `recv` is this member's buffer of the
        // same size at the root, and (insignificant) null elsewhere.
        let code = unsafe {
            ffi::MPI_Reduce(
                send.as_ptr() as *const c_void,
                recv,
                n,
                datatype(dtype),
                mpi_op(op),
                root as i32,
                self.comm.0.as_raw(),
            )
        };
        self.check(name, "MPI_Reduce", code)
    }

    fn send(&self, _dtype: DType, b: &[u8], peer: usize) -> Result<(), CommError> {
        let name = "send";
        let n = count(name, "buffer", b.len())?;
        // Never empty (see `placed`); the extra byte is not sent.
        let mut data = Vec::with_capacity(b.len() + 1);
        data.extend_from_slice(b);
        let _call = self.watchdog.enter(|| self.name(name));
        self.reap_sends(false)?;
        // SAFETY: MPI_REQUEST_NULL is a valid initial value, overwritten by MPI_Isend.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `data` holds `n` bytes and stays alive (in `sends`, its heap buffer never
        // moves) until MPI reports the send complete.
        let code = unsafe {
            ffi::MPI_Isend(
                data.as_ptr() as *const c_void,
                n,
                u8::equivalent_datatype().as_raw(),
                peer as i32,
                P2P_TAG,
                self.comm.0.as_raw(),
                &mut request,
            )
        };
        self.check(name, "MPI_Isend", code)?;
        lock(&self.sends).push(PendingSend {
            _data: data,
            request,
        });
        Ok(())
    }

    fn recv(&self, _dtype: DType, b: &mut [u8], peer: usize) -> Result<(), CommError> {
        let name = "recv";
        let _call = self.watchdog.enter(|| self.name(name));
        self.reap_sends(false)?;
        let from = self.comm.0.process_at_rank(peer as i32);
        let got = from
            .probe_with_tag(P2P_TAG)
            .count(u8::equivalent_datatype());
        if usize::try_from(got).ok() != Some(b.len()) {
            return Err(CommError::Mismatch {
                op: self.name(name),
                detail: format!(
                    "member {} expects {} bytes from member {peer}, which sent {got} bytes",
                    self.me,
                    b.len()
                ),
            });
        }
        let mut spare = [0u8];
        from.receive_into_with_tag(placed_mut(b, &mut spare), P2P_TAG);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        let _call = self.watchdog.enter(|| self.name("barrier"));
        self.reap_sends(false)?;
        self.comm.0.barrier();
        Ok(())
    }

    fn sub_group(&self, members: &[usize], me: usize) -> Result<SharedComm, CommError> {
        let name = "sub_group";
        cached_sub_group(&self.subs, members, &self.ranks, |ranks| {
            let indices: Vec<i32> = members.iter().map(|&m| m as i32).collect();
            // Groups made at the same time by overlapping members are told apart by their ranks.
            let tag = (ranks
                .iter()
                .fold(17u32, |h, &r| h.wrapping_mul(31).wrapping_add(r as u32))
                & 0x7fff) as i32;
            let comm = {
                let _call = self.watchdog.enter(|| self.name(name));
                let group = self.comm.0.group().include(&indices);
                self.comm.0.split_by_subgroup_with_tag(&group, tag)
            };
            let comm = comm.ok_or_else(|| CommError::InvalidArgument {
                op: self.name(name),
                detail: format!(
                    "MPI_Comm_create_group gave no communicator for members {members:?}"
                ),
            })?;
            Ok(Arc::new(MpiComm::new(
                self.watchdog.clone(),
                comm,
                ranks,
                me,
            )))
        })
    }
}
