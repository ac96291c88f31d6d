//! `NcclComm`: the `Communicator` on CUDA device buffers through NCCL, with stream ordering and
//! an error watchdog.
//!
//! Streams: each communicator owns a comm stream (highest priority). Every collective makes the comm stream wait
//! (an event) for the work already queued on the *compute stream* (the stream the tensor layer
//! launches its kernels on; the context's default stream unless set), queues the NCCL calls,
//! and makes the compute stream wait for their end. Kernels and collectives therefore run in
//! program order with no host synchronisation. In [`Completion::Blocking`] (the default) the
//! call also waits for the collective to finish; in [`Completion::Async`] it returns once the
//! work is queued and errors surface at the next call or at [`NcclComm::synchronize`].
//!
//! Watchdog: a thread per communicator polls `ncclCommGetAsyncError` and the completion events
//! of queued collectives. An async error, or a collective still running `timeout` after it was
//! queued (a dead or absent peer), aborts the NCCL communicator (`ncclCommAbort`, which also
//! stops its kernels) and turns every later call into a `CommError`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr as _};

use super::exchange::IdExchange;
use super::ffi::{self, nccl_dtype, nccl_op, Nccl, Stream, UniqueId};
use crate::cuda_libs::{self, LibSearch};
use crate::trace::Lane;
use crate::{Backend, Buf, BufMut, CommError, DType, ReduceOp, SharedComm};

/// Whether a collective call waits for the device to finish it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Wait (with the watchdog's timeout) before returning.
    Blocking,
    /// Return once queued; ordering with the compute stream is kept by events.
    Async,
}

/// What the end of a call means to the owners of its buffers (see `crate::DeviceFence`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Every member takes part; the end depends on no later work of any of them.
    Collective,
    /// A point-to-point send: it ends once the receiver posted its receive.
    Send,
}

struct RawComm(ffi::NcclComm);
// SAFETY: the handle is only used under `Inner::calls` (plus ncclCommAbort/GetAsyncError,
// which NCCL documents as callable from another thread, by the watchdog).
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

#[derive(Default)]
struct Watch {
    failure: Mutex<Option<String>>,
    pending: Mutex<VecDeque<(Arc<CudaEvent>, Instant, &'static str)>>,
    stop: AtomicBool,
    aborted: AtomicBool,
    timed_out: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn dev_err(op: &str, e: impl std::fmt::Display) -> CommError {
    CommError::Device(format!("{op}: CUDA driver: {e}"))
}

struct Inner {
    nccl: &'static Nccl,
    raw: RawComm,
    ctx: Arc<CudaContext>,
    comm_stream: Arc<CudaStream>,
    compute: Mutex<Arc<CudaStream>>,
    rank: usize,
    size: usize,
    world_ranks: Vec<usize>,
    /// Flight-recorder group and call counter, shared by every handle.
    log: crate::flight::CommLog,
    device: usize,
    timeout: Duration,
    exchange: Arc<dyn IdExchange>,
    key: String,
    completion: Mutex<Completion>,
    calls: Mutex<()>,
    /// Sub-communicators in creation order: dropped (ncclCommDestroy) in that order, which is
    /// the same on every member, so destroys that wait for peers cannot deadlock.
    subs: Mutex<Vec<(Vec<usize>, SharedComm)>>,
    /// One-way channels by (from, to) member: dropped first, in that key order (the same on
    /// both members of each).
    channels: Mutex<BTreeMap<(usize, usize), SharedComm>>,
    scratch: Mutex<Option<CudaSlice<f32>>>,
    watch: Arc<Watch>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// The rank's heartbeat to the job's store (world communicators started by a launcher).
    heartbeat: Mutex<Option<crate::heartbeat::HeartbeatThread>>,
}

/// A communicator of NCCL ranks, one CUDA device each.
#[derive(Clone)]
pub struct NcclComm {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("device", &self.inner.device)
            .field("key", &self.inner.key)
            .finish()
    }
}

/// Parameters of [`NcclComm::init_with`].
#[derive(Clone, Debug)]
pub struct NcclOptions {
    /// Names the job in exchange keys, so jobs sharing a store do not meet.
    pub job: String,
    pub timeout: Duration,
    pub completion: Completion,
    pub libs: LibSearch,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            job: "oxiflow".into(),
            timeout: Duration::from_secs(300),
            completion: Completion::Blocking,
            libs: LibSearch::default(),
        }
    }
}

impl NcclComm {
    /// The world communicator: `rank` of `world`, on CUDA device `device`, meeting the others
    /// through `store`. Fails with a typed error when CUDA or NCCL is missing or a peer does
    /// not arrive within `timeout`.
    pub fn init(
        store: Arc<dyn IdExchange>,
        rank: usize,
        world: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<NcclComm, CommError> {
        let opts = NcclOptions {
            timeout,
            ..NcclOptions::default()
        };
        Self::init_with(store, rank, world, device, &opts)
    }

    /// [`NcclComm::init`] with every option.
    pub fn init_with(
        store: Arc<dyn IdExchange>,
        rank: usize,
        world: usize,
        device: usize,
        opts: &NcclOptions,
    ) -> Result<NcclComm, CommError> {
        if world == 0 || rank >= world {
            return Err(CommError::InvalidArgument {
                op: "nccl init".into(),
                detail: format!("rank {rank} of world {world}"),
            });
        }
        cuda_libs::ensure_driver(&opts.libs).map_err(|e| CommError::Device(e.to_string()))?;
        let nccl = ffi::nccl(&opts.libs)?;
        let ndev = cuda_libs::device_count(&opts.libs).map_err(CommError::Device)?;
        if device >= ndev {
            return Err(CommError::InvalidArgument {
                op: "nccl init".into(),
                detail: format!("device {device} requested, {ndev} CUDA device(s) visible"),
            });
        }
        let ctx = CudaContext::new(device).map_err(|e| dev_err("nccl init: context", e))?;
        // OxiFlow orders streams itself (events below); cudarc's per-slice tracking would add
        // host-side waits.
        // SAFETY: called before any slice of this context is shared across streams.
        unsafe { ctx.disable_event_tracking() };
        let compute = ctx.default_stream();
        let key = format!("{}/nccl/world", opts.job);
        let world_ranks = (0..world).collect();
        Self::create(
            nccl,
            ctx,
            compute,
            store,
            key,
            rank,
            world_ranks,
            opts.timeout,
            opts.completion,
        )
    }

    /// Keeps `heartbeat` running as long as this communicator (any handle of it) lives.
    pub(crate) fn keep_heartbeat(&self, heartbeat: Option<crate::heartbeat::HeartbeatThread>) {
        *lock(&self.inner.heartbeat) = heartbeat;
    }

    #[allow(clippy::too_many_arguments)]
    fn create(
        nccl: &'static Nccl,
        ctx: Arc<CudaContext>,
        compute: Arc<CudaStream>,
        exchange: Arc<dyn IdExchange>,
        key: String,
        rank: usize,
        world_ranks: Vec<usize>,
        timeout: Duration,
        completion: Completion,
    ) -> Result<NcclComm, CommError> {
        let size = world_ranks.len();
        let op = format!("nccl init of {key} (rank {rank} of {size})");
        // Liveness first: every member announces itself, so a missing peer is a timeout here
        // rather than a hang inside ncclCommInitRank.
        exchange.set(&format!("{key}/alive/{rank}"), b"1")?;
        let alive: Vec<String> = (0..size).map(|r| format!("{key}/alive/{r}")).collect();
        let alive_refs: Vec<&str> = alive.iter().map(String::as_str).collect();
        exchange
            .wait(&alive_refs, timeout)
            .map_err(|e| CommError::Timeout {
                op: format!("{op}: waiting for peers ({e})"),
                timeout,
                missing: vec![],
            })?;
        let uid_key = format!("{key}/uid");
        let uid = if rank == 0 {
            let mut id = UniqueId { internal: [0; 128] };
            // SAFETY: writes one ncclUniqueId.
            nccl.check(&op, std::ptr::null_mut(), unsafe {
                (nccl.get_unique_id)(&mut id)
            })?;
            exchange.set(&uid_key, &id.internal)?;
            id
        } else {
            let v = exchange.wait(&[&uid_key], timeout)?;
            let bytes = v.into_iter().next().unwrap_or_default();
            let internal: [u8; 128] =
                bytes
                    .as_slice()
                    .try_into()
                    .map_err(|_| CommError::Mismatch {
                        op: op.clone(),
                        detail: format!("unique id of {} bytes, expected 128", bytes.len()),
                    })?;
            UniqueId { internal }
        };
        ctx.bind_to_thread().map_err(|e| dev_err(&op, e))?;
        let mut raw: ffi::NcclComm = std::ptr::null_mut();
        // SAFETY: raw receives a new communicator; the device is current on this thread.
        nccl.check(&op, std::ptr::null_mut(), unsafe {
            (nccl.comm_init_rank)(&mut raw, size as i32, uid, rank as i32)
        })?;
        // The comm stream has the highest priority: a collective's blocks are scheduled ahead
        // of queued compute blocks, so a kernel launched while a collective runs (the pack of
        // the next transfer) overlaps it instead of delaying its start.
        let (_, highest) =
            cudarc::driver::result::stream::get_priority_range().map_err(|e| dev_err(&op, e))?;
        let comm_stream = ctx
            .new_stream_with_priority(highest)
            .map_err(|e| dev_err(&op, e))?;
        let watch = Arc::new(Watch::default());
        let device = ctx.ordinal();
        let inner = Arc::new(Inner {
            nccl,
            raw: RawComm(raw),
            ctx,
            comm_stream,
            compute: Mutex::new(compute),
            rank,
            size,
            log: crate::flight::CommLog::new(&world_ranks),
            world_ranks,
            device,
            timeout,
            exchange,
            key,
            completion: Mutex::new(completion),
            calls: Mutex::new(()),
            subs: Mutex::new(Vec::new()),
            channels: Mutex::new(BTreeMap::new()),
            scratch: Mutex::new(None),
            watch,
            watchdog: Mutex::new(None),
            heartbeat: Mutex::new(None),
        });
        let weak = Arc::downgrade(&inner);
        let handle = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{}", inner.rank))
            .spawn(move || watchdog(weak))
            .map_err(|source| CommError::Io {
                context: "nccl: starting the watchdog thread".into(),
                source,
            })?;
        *lock(&inner.watchdog) = Some(handle);
        Ok(NcclComm { inner })
    }

    /// The CUDA context (device) of this communicator.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    /// The stream NCCL runs on.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.inner.comm_stream
    }

    /// The stream collectives are ordered after (and before): where the caller's kernels run.
    pub fn compute_stream(&self) -> Arc<CudaStream> {
        lock(&self.inner.compute).clone()
    }

    /// Sets the compute stream (must belong to this communicator's context).
    pub fn set_compute_stream(&self, stream: Arc<CudaStream>) {
        *lock(&self.inner.compute) = stream;
    }

    pub fn set_completion(&self, c: Completion) {
        *lock(&self.inner.completion) = c;
    }

    /// NCCL's version code and the library path it was loaded from.
    pub fn library(&self) -> (i32, String) {
        (
            self.inner.nccl.version().unwrap_or(0),
            self.inner.nccl.path.clone(),
        )
    }

    /// Waits (with the timeout) until every queued collective finished.
    pub fn synchronize(&self) -> Result<(), CommError> {
        let last = lock(&self.inner.watch.pending)
            .back()
            .map(|(e, t, op)| (e.clone(), *t, *op));
        match last {
            Some((ev, t, op)) => self.inner.wait_event(op, &ev, t),
            None => self.inner.check_failed("synchronize"),
        }
    }

    /// The raw `ncclComm_t` and comm stream, for a tight loop of bare NCCL calls (benchmarks).
    ///
    /// # Safety
    /// The caller must not use the handle concurrently with this communicator's calls, after
    /// it is dropped, or after an abort.
    pub unsafe fn raw_handle(&self) -> (&'static Nccl, ffi::NcclComm, Stream) {
        (
            self.inner.nccl,
            self.inner.raw.0,
            self.inner.comm_stream.cu_stream() as Stream,
        )
    }

    /// Runs raw NCCL calls on the comm stream with the ordering and watchdog of every
    /// collective (for benchmarks of the bare library and for callers needing a call the
    /// trait lacks). `f` gets the raw `ncclComm_t` and `cudaStream_t`.
    ///
    /// # Safety
    /// `f` must only queue valid NCCL work on that comm and stream.
    pub unsafe fn raw_call(
        &self,
        op: &'static str,
        f: impl FnOnce(&Nccl, ffi::NcclComm, Stream) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        self.inner
            .run(op, None, End::Collective, |n, c, s| f(n, c, s))
    }
}

impl Inner {
    fn check_failed(&self, op: &str) -> Result<(), CommError> {
        match lock(&self.watch.failure).as_ref() {
            None => Ok(()),
            Some(msg) => {
                if self.watch.timed_out.load(Ordering::Acquire) {
                    Err(CommError::Timeout {
                        op: format!("{op} on nccl comm {} ({msg})", self.key),
                        timeout: self.timeout,
                        missing: vec![],
                    })
                } else {
                    Err(CommError::PeerLost {
                        op: op.to_string(),
                        rank: self.rank,
                        detail: format!("nccl comm {} failed: {msg}", self.key),
                    })
                }
            }
        }
    }

    fn abort(&self, why: String, timed_out: bool) {
        let mut f = lock(&self.watch.failure);
        if f.is_none() {
            *f = Some(why);
            self.watch.timed_out.store(timed_out, Ordering::Release);
        }
        drop(f);
        if !self.watch.aborted.swap(true, Ordering::AcqRel) {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: abort is documented as callable while operations hang.
            unsafe { (self.nccl.comm_abort)(self.raw.0) };
        }
    }

    fn poll_async_error(&self) -> Option<String> {
        if self.watch.aborted.load(Ordering::Acquire) {
            return None;
        }
        let mut e = ffi::NCCL_SUCCESS;
        // SAFETY: reads the comm's async error.
        let r = unsafe { (self.nccl.comm_get_async_error)(self.raw.0, &mut e) };
        if r != ffi::NCCL_SUCCESS {
            return Some(self.nccl.describe(self.raw.0, r));
        }
        if e != ffi::NCCL_SUCCESS && e != ffi::NCCL_IN_PROGRESS {
            return Some(self.nccl.describe(self.raw.0, e));
        }
        None
    }

    /// Waits for `ev` (queued at `t`), polling errors, until `t + timeout`.
    fn wait_event(&self, op: &str, ev: &CudaEvent, t: Instant) -> Result<(), CommError> {
        self.ctx.bind_to_thread().map_err(|e| dev_err(op, e))?;
        let mut spins = 0u32;
        loop {
            self.check_failed(op)?;
            match ev.try_is_complete() {
                Ok(true) => return self.check_failed(op),
                Ok(false) => {}
                Err(e) => return Err(dev_err(op, e)),
            }
            if let Some(msg) = self.poll_async_error() {
                self.abort(msg, false);
                continue;
            }
            if t.elapsed() > self.timeout {
                self.abort(format!("{op} still running after {:?}", self.timeout), true);
                continue;
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Queues `f` on the comm stream after the compute stream's queued work. With `fences`
    /// (every buffer of the call is fenced, see [`crate::DeviceFence`]) the compute stream
    /// does not wait for the call: each fence gets its end event, as a collective's or (`end`)
    /// a send's. Otherwise the compute stream waits for it at once.
    fn run(
        &self,
        op: &'static str,
        fences: Option<&[&dyn crate::DeviceFence]>,
        end: End,
        f: impl FnOnce(&Nccl, ffi::NcclComm, Stream) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        self.check_failed(op)?;
        let _g = lock(&self.calls);
        self.ctx.bind_to_thread().map_err(|e| dev_err(op, e))?;
        let compute = lock(&self.compute).clone();
        let same = compute.cu_stream() == self.comm_stream.cu_stream();
        if !same {
            let ev_in = compute.record_event(None).map_err(|e| dev_err(op, e))?;
            self.comm_stream.wait(&ev_in).map_err(|e| dev_err(op, e))?;
        }
        let traced = crate::device_trace::begin(&self.comm_stream);
        f(
            self.nccl,
            self.raw.0,
            self.comm_stream.cu_stream() as Stream,
        )?;
        crate::device_trace::end(&self.comm_stream, Lane::CudaComm, op, traced);
        let ev_out = Arc::new(
            self.comm_stream
                .record_event(None)
                .map_err(|e| dev_err(op, e))?,
        );
        match fences {
            Some(fs) if !fs.is_empty() => {
                for fence in fs {
                    match end {
                        End::Collective => fence.after_collective(&ev_out),
                        End::Send => fence.after_send(&ev_out),
                    }
                }
            }
            _ if !same => compute.wait(&ev_out).map_err(|e| dev_err(op, e))?,
            _ => {}
        }
        // A call captured into a CUDA graph runs when the graph is launched: its end event is
        // no event the host may query (querying one would break the capture), so neither the
        // watchdog nor a blocking completion waits for it.
        let captured = compute.capture_status().is_ok_and(|s| {
            s != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        });
        if captured {
            return Ok(());
        }
        let t = Instant::now();
        lock(&self.watch.pending).push_back((ev_out.clone(), t, op));
        if *lock(&self.completion) == Completion::Blocking {
            self.wait_event(op, &ev_out, t)?;
        }
        Ok(())
    }

    fn group(
        &self,
        op: &str,
        body: impl FnOnce() -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let n = self.nccl;
        // SAFETY: group calls bracket the point-to-point calls of `body`.
        n.check(op, self.raw.0, unsafe { (n.group_start)() })?;
        let r = body();
        // Always close the group, even when a call inside failed.
        // SAFETY: closes the group opened above on this thread.
        let e = unsafe { (n.group_end)() };
        r?;
        n.check(op, self.raw.0, e)
    }
}

fn watchdog(weak: Weak<Inner>) {
    loop {
        std::thread::sleep(Duration::from_millis(5));
        let Some(inner) = weak.upgrade() else { return };
        if inner.watch.stop.load(Ordering::Acquire) || inner.watch.aborted.load(Ordering::Acquire) {
            return;
        }
        if inner.ctx.bind_to_thread().is_err() {
            continue;
        }
        if let Some(msg) = inner.poll_async_error() {
            inner.abort(msg, false);
            return;
        }
        let mut p = lock(&inner.watch.pending);
        while let Some((ev, t, op)) = p.front() {
            if ev.is_complete() {
                p.pop_front();
                continue;
            }
            if t.elapsed() > inner.timeout {
                let msg = format!(
                    "{op} still running after {:?} (peer dead or absent?)",
                    inner.timeout
                );
                drop(p);
                inner.abort(msg, true);
                return;
            }
            break;
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for (_, channel) in std::mem::take(&mut *lock(&self.channels)) {
            drop(channel);
        }
        self.watch.stop.store(true, Ordering::Release);
        // The watchdog holds only a Weak; it exits at its next tick.
        let _ = self.ctx.bind_to_thread();
        if self.watch.aborted.load(Ordering::Acquire) {
            return;
        }
        let last = lock(&self.watch.pending)
            .back()
            .map(|(e, t, _)| (e.clone(), *t));
        let clean = match last {
            Some((ev, t)) => self.wait_event("drop", &ev, t).is_ok(),
            None => true,
        };
        memory::forget_comm(self, clean && !self.watch.aborted.load(Ordering::Acquire));
        if clean && !self.watch.aborted.load(Ordering::Acquire) {
            // SAFETY: no work is pending on the comm.
            unsafe { (self.nccl.comm_destroy)(self.raw.0) };
        } else if !self.watch.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: abort of a comm with hung work.
            unsafe { (self.nccl.comm_abort)(self.raw.0) };
        }
    }
}

mod collectives;
mod memory;

pub use memory::NcclMemory;
