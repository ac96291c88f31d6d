//! The caching device allocator: size-bucketed free lists per device runtime, and the fences
//! that order the compute stream after collectives on other streams.
//!
//! Every kernel and copy of the tensor layer runs on the runtime's one compute stream. NCCL
//! runs on comm streams; a collective on a block does not make the compute stream wait (see
//! `oxiflow_collectives::DeviceFence`) but leaves its end event on the block. The compute
//! stream waits for those events when the block's address is next taken (`Block::ptr`), and a
//! freed block keeps them in the free list: it is handed out again once they completed, or,
//! when a bucket already has `MAX_IN_FLIGHT` such blocks, after the compute stream waits for
//! the oldest one. So a block is never touched by the compute stream, reused or freed while a
//! collective may still read or write it, and no host thread waits for a collective to end.
//! A point-to-point send's end (`DeviceFence::after_send`) waits for its receiver, whose
//! progress may wait for this rank's later work: no stream ever waits for one. A block a send
//! may still read is handed out again only once the send ended (a bucket allocates afresh
//! instead), kept past the cache limit, and kept through a release after an out-of-memory.
//!
//! Blocks of at least `DRIVER_REUSE_FROM` bytes (`set_driver_reuse_from`) are not kept in a
//! free list when freed: they go back, in stream order, to the device's stream-ordered pool
//! (`driver_pool`), which keeps the bytes and serves allocations of any size from them. The
//! free lists reuse a block only for its own bucket, so they hold the most-ever-live blocks of
//! every size at once; the driver's pool holds about the most bytes ever live together. Such
//! a block freed while a collective still uses it (a gradient bucket's buffer, dropped once
//! its all-reduce is queued) waits on the side until the collective's end event completes and
//! goes back then (the next free looks), so the compute stream never waits for it.
//!
//! When asked (`set_nccl_memory`), the blocks come from NCCL's allocator (`NcclMemory`), which collectives
//! register for zero-copy transfers; blocks under `SLAB` bytes are carved from `SLAB`-byte
//! allocations (NCCL's allocator rounds every request up to the VMM granularity). Every block
//! of every rank is then registered memory, as NCCL requires of both sides of a transfer.
//! `NcclMemory` is freed at once (not ordered on a stream), so the pool waits for the compute
//! stream before it lets one go.
//!
//! While a CUDA graph is captured (`graph.rs`), the pool keeps the graph's memory apart
//! (`GraphMemory`): every block made or freed during the capture belongs to the graph from
//! then on (its address is baked into the graph's kernels), blocks freed during the capture
//! are reused only by later allocations of the same capture (ordered on the captured stream),
//! new blocks come from `cuMemAlloc` (a stream-ordered allocation would become a node of the
//! graph), a block from the pool serves only when idle (the captured stream may not wait for
//! work queued before the capture), no host thread queries an event recorded during the
//! capture, and the capture's
//! collective end events are kept so the compute stream joins them before the capture ends.
//! The graph's blocks go back to the pool when the graph is dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr as _};
use oxiflow_collectives::nccl::NcclMemory;

/// Bytes kept in the free lists at most when the device's size is unknown; more is given back
/// to the driver.
const MAX_CACHED: usize = 16 << 30;

/// The free lists' limit on a device of `total` bytes: three quarters of it (giving a block
/// back costs a synchronisation, and a later allocation of that size a driver call).
fn cache_limit(total: Option<usize>) -> usize {
    total.map_or(MAX_CACHED, |t| (t / 4) * 3)
}

/// The bucket of a request: powers of two up to 1 MiB, multiples of 128 KiB up to 32 MiB,
/// then multiples of 2 MiB (at most an eighth, then a sixteenth, more than asked: a GPT-2
/// [768, 768] f32 weight is 2.25 MiB, which 2 MiB steps held in 4 MiB).
pub(crate) fn bucket(bytes: usize) -> usize {
    let b = bytes.max(512);
    if b <= 1 << 20 {
        b.next_power_of_two()
    } else if b <= 32 << 20 {
        b.div_ceil(128 << 10) * (128 << 10)
    } else {
        b.div_ceil(2 << 20) * (2 << 20)
    }
}

/// Freed blocks of one bucket whose collectives may still run, beyond which the compute stream
/// waits for the oldest instead of allocating more (bounds memory when the host runs ahead).
const MAX_IN_FLIGHT: usize = 6;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes `stream` wait for `events` (a failed wait falls back to waiting on the host).
pub(crate) fn order_after(stream: &CudaStream, events: &[Arc<CudaEvent>]) {
    for ev in events {
        if stream.wait(ev).is_err() {
            // The context is broken: the next launch on it reports the error.
            let _ = ev.synchronize();
        }
    }
}

/// NCCL allocations are at least this large; smaller blocks are carved from one.
const SLAB: usize = 2 << 20;

/// Where a block's bytes live.
pub(crate) enum Memory {
    /// `cuMemAllocAsync` on the compute stream (freed in stream order).
    Driver(CudaSlice<u8>),
    /// Bytes `offset..` of an NCCL allocation (shared by the blocks carved from one slab).
    Nccl(Arc<NcclMemory>, usize),
    /// `cuMemAlloc` (made while a graph was captured), freed at once when dropped.
    Sync(SyncMemory),
}

impl Memory {
    pub(crate) fn ptr(&self, stream: &CudaStream) -> u64 {
        match self {
            Memory::Driver(s) => s.device_ptr(stream).0,
            Memory::Nccl(m, off) => m.ptr() + *off as u64,
            Memory::Sync(m) => m.0,
        }
    }
    /// Whether dropping it frees the bytes at once (not in stream order): the pool waits for
    /// the compute stream first.
    fn freed_at_once(&self) -> bool {
        matches!(self, Memory::Nccl(..) | Memory::Sync(_))
    }
}

/// A `cuMemAlloc` allocation, freed by `cuMemFree` on drop (the pool waits for the compute
/// stream before it drops one).
pub(crate) struct SyncMemory(u64);

impl SyncMemory {
    pub(crate) fn alloc(bytes: usize) -> std::result::Result<SyncMemory, String> {
        // SAFETY: the caller bound the runtime's context to this thread; the bytes are
        // written before they are read (the pool's contract).
        unsafe { cudarc::driver::result::malloc_sync(bytes) }
            .map(SyncMemory)
            .map_err(|e| e.to_string())
    }
}

impl Drop for SyncMemory {
    fn drop(&mut self) {
        // SAFETY: the address came from `cuMemAlloc` and is freed once; no queued work uses
        // it any more (the pool synchronised the stream before letting the block go).
        let _ = unsafe { cudarc::driver::result::free_sync(self.0) };
    }
}

/// The memory of one captured CUDA graph: the blocks made or freed while it was captured
/// (its kernels read and write them on every launch), and the end events of the collectives
/// captured in it.
#[derive(Default)]
pub(crate) struct GraphMemory {
    /// Blocks no piece holds any more, by bucket: reused by later allocations while the
    /// capture runs, kept (for the graph's launches) once it ended.
    kept: Mutex<HashMap<usize, Vec<Cached>>>,
    /// Whether the capture still runs (its free blocks may be reused).
    pub(crate) capturing: AtomicBool,
    /// Whether the graph lives (false: its blocks go back to the pool).
    live: AtomicBool,
    /// End events of the collectives captured (the compute stream joins them at the end).
    pub(crate) events: Mutex<Vec<Arc<CudaEvent>>>,
    /// Pinned host copies of what the capture uploaded: a captured copy reads its source at
    /// every launch, so the source lives as long as the graph.
    uploads: Mutex<Vec<PinnedHost>>,
}

/// Page-locked host memory (`cuMemHostAlloc`), freed on drop.
struct PinnedHost {
    ptr: *mut std::ffi::c_void,
}

// SAFETY: the pointer is owned (freed once, on drop) and only read by the device after the
// bytes were written; no host reference to it escapes `GraphMemory::upload_source`.
unsafe impl Send for PinnedHost {}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by `cuMemHostAlloc` and freed once; the graph that read it is gone
        // (its memory is dropped with it) or never ran.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr) };
    }
}

impl GraphMemory {
    /// A free block of the capture in bucket `cap`, once `stream` waits for its collectives
    /// (a dependency inside the captured graph).
    pub(crate) fn take(&self, cap: usize, stream: &CudaStream) -> Option<Memory> {
        if !self.capturing.load(Ordering::Acquire) {
            return None;
        }
        let c = lock(&self.kept).get_mut(&cap)?.pop()?;
        order_after(stream, &c.fences);
        order_after(stream, &c.sends);
        Some(c.mem)
    }
    /// Keeps a block the graph's kernels use; false when the graph is gone (the caller gives
    /// the block to the pool).
    pub(crate) fn keep(&self, cap: usize, c: Cached) -> std::result::Result<(), Cached> {
        if !self.live.load(Ordering::Acquire) {
            return Err(c);
        }
        lock(&self.kept).entry(cap).or_default().push(c);
        Ok(())
    }
    /// The captured collectives' end events, taken (for the join at the end of the capture).
    pub(crate) fn take_events(&self) -> Vec<Arc<CudaEvent>> {
        std::mem::take(&mut *lock(&self.events))
    }
    /// A pinned host copy of `src` that lives as long as the graph, for a captured upload to
    /// read at every launch.
    pub(crate) fn upload_source(&self, src: &[u8]) -> std::result::Result<&[u8], String> {
        // SAFETY: a fresh allocation of src.len() bytes (the caller's context is bound).
        let ptr = unsafe { cudarc::driver::result::malloc_host(src.len(), 0) }
            .map_err(|e| e.to_string())?;
        // SAFETY: `ptr` holds src.len() bytes and does not overlap `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), ptr.cast::<u8>(), src.len()) };
        lock(&self.uploads).push(PinnedHost { ptr });
        // SAFETY: the bytes stay allocated and unchanged until this GraphMemory drops (the
        // slice borrows it), which outlives every launch of the graph that reads them.
        Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), src.len()) })
    }
    /// Bytes of the blocks kept.
    pub(crate) fn kept_bytes(&self) -> usize {
        lock(&self.kept).iter().map(|(cap, l)| cap * l.len()).sum()
    }
}

/// A free block, the end events of collectives that may still use it, and of sends that may
/// still read it.
pub(crate) struct Cached {
    pub(crate) mem: Memory,
    pub(crate) fences: Vec<Arc<CudaEvent>>,
    pub(crate) sends: Vec<Arc<CudaEvent>>,
}

impl Cached {
    fn idle(&mut self) -> bool {
        self.fences.retain(|e| !e.is_complete());
        !self.sending() && self.fences.is_empty()
    }
    /// Whether a send may still read the block.
    fn sending(&mut self) -> bool {
        self.sends.retain(|e| !e.is_complete());
        !self.sends.is_empty()
    }
}

#[derive(Default)]
pub(crate) struct Pool {
    free: Mutex<HashMap<usize, Vec<Cached>>>,
    cached: AtomicUsize,
    /// New blocks come from NCCL's allocator (see the module doc).
    nccl: AtomicBool,
    /// The free lists' limit in bytes (0: not read off the device yet).
    limit: AtomicUsize,
    /// Driver blocks of at least this many bytes go back to the device's stream-ordered pool
    /// when freed, which serves any size from them (0: every block is cached by bucket).
    driver_from: AtomicUsize,
    /// Driver allocations, blocks given back (past the limit or to the driver's pool), and
    /// full releases (out of memory).
    counts: [AtomicUsize; 3],
    /// Blocks bound for the driver whose collectives were still running when they were
    /// freed: given back once those end (every `put` looks), so freeing a collective's
    /// buffer never makes the compute stream wait for the collective.
    deferred: Mutex<Vec<Cached>>,
    /// The graph being captured, if any (see the module doc).
    capture: Mutex<Option<Arc<GraphMemory>>>,
    /// Whether `capture` is set (read on every allocation and free).
    pub(crate) capturing: AtomicBool,
}

/// How often the pool went to the driver: `(allocations, blocks given back past the cache
/// limit or to the driver's stream-ordered pool, full releases after an out-of-memory)`, since
/// the process started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocCounts {
    pub fresh: usize,
    pub given_back: usize,
    pub released_all: usize,
}

impl Pool {
    pub(crate) fn counts(&self) -> AllocCounts {
        let c = |i: usize| self.counts[i].load(Ordering::Relaxed);
        AllocCounts {
            fresh: c(0),
            given_back: c(1),
            released_all: c(2),
        }
    }
    pub(crate) fn count(&self, i: usize) {
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }
    fn limit(&self, ctx: &CudaContext) -> usize {
        let l = self.limit.load(Ordering::Relaxed);
        if l != 0 {
            return l;
        }
        let total = ctx
            .bind_to_thread()
            .ok()
            .and_then(|_| cudarc::driver::result::mem_get_info().ok())
            .map(|(_, total)| total);
        let l = cache_limit(total);
        self.limit.store(l, Ordering::Relaxed);
        l
    }
    /// Driver blocks of at least `from` bytes (None: none) go back to the device's
    /// stream-ordered pool when freed instead of to a free list, and that pool keeps what is
    /// freed to it: one reservation serves every size, where the free lists keep each bucket's
    /// most-ever-live blocks apart. The blocks cached at or above `from` are given back now.
    pub(crate) fn set_driver_from(
        &self,
        from: Option<usize>,
        ctx: &CudaContext,
        stream: &CudaStream,
    ) -> std::result::Result<(), String> {
        if from.is_some() {
            super::driver_pool::keep_freed(ctx)?;
        }
        let from = from.map_or(0, |b| b.max(1));
        if self.driver_from.swap(from, Ordering::AcqRel) != from
            && from != 0
            && self.cached_bytes() > 0
        {
            self.release_all(stream);
        }
        Ok(())
    }
    /// Whether a freed block of `cap` bytes in `mem` goes back to the driver's pool (never while
    /// a graph is captured: the free would become a node of the graph).
    fn to_driver(&self, cap: usize, mem: &Memory) -> bool {
        let from = self.driver_from.load(Ordering::Relaxed);
        from != 0
            && cap >= from
            && matches!(mem, Memory::Driver(_))
            && !self.capturing.load(Ordering::Acquire)
    }
    pub(crate) fn cached_bytes(&self) -> usize {
        self.cached.load(Ordering::Relaxed)
    }
    /// The graph being captured, if any.
    pub(crate) fn capture(&self) -> Option<Arc<GraphMemory>> {
        if !self.capturing.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.capture).clone()
    }
    /// Starts keeping a graph's memory apart (see the module doc); None when a capture
    /// already runs.
    pub(crate) fn begin_capture(&self) -> Option<Arc<GraphMemory>> {
        let mut g = lock(&self.capture);
        if g.is_some() {
            return None;
        }
        let m = Arc::new(GraphMemory::default());
        m.capturing.store(true, Ordering::Release);
        m.live.store(true, Ordering::Release);
        *g = Some(m.clone());
        self.capturing.store(true, Ordering::Release);
        Some(m)
    }
    /// Ends the capture of `m`: its blocks stay the graph's while `keep` (the graph was made),
    /// else they go back to the pool (nothing of the capture ran).
    pub(crate) fn end_capture(
        &self,
        m: &Arc<GraphMemory>,
        keep: bool,
        ctx: &CudaContext,
        stream: &CudaStream,
    ) {
        let mut g = lock(&self.capture);
        if g.as_ref().is_some_and(|c| Arc::ptr_eq(c, m)) {
            *g = None;
            self.capturing.store(false, Ordering::Release);
        }
        drop(g);
        m.capturing.store(false, Ordering::Release);
        if !keep {
            self.release_graph(m, ctx, stream);
        }
    }
    /// Gives the blocks of a graph that is gone back to the pool (its launches are ordered
    /// before any later work on the compute stream).
    pub(crate) fn release_graph(&self, m: &GraphMemory, ctx: &CudaContext, stream: &CudaStream) {
        m.live.store(false, Ordering::Release);
        let kept = std::mem::take(&mut *lock(&m.kept));
        for (cap, list) in kept {
            for c in list {
                self.put(cap, c, ctx, stream);
            }
        }
    }
    /// A free block of `cap` bytes that `stream` may use now: an idle one, else (with
    /// `MAX_IN_FLIGHT` busy ones waiting, and `may_wait`) the oldest no send may still read,
    /// after `stream` waits for its collectives. While a graph is captured a stream may not
    /// wait for work queued before the capture (the capture would be invalidated), so only
    /// an idle block serves then.
    pub(crate) fn take(&self, cap: usize, stream: &CudaStream, may_wait: bool) -> Option<Memory> {
        let mut g = lock(&self.free);
        let list = g.get_mut(&cap)?;
        let pick = match list.iter_mut().position(Cached::idle) {
            Some(i) => i,
            None if may_wait && list.len() >= MAX_IN_FLIGHT => {
                list.iter_mut().position(|c| !c.sending())?
            }
            None => return None,
        };
        let c = list.remove(pick);
        drop(g);
        order_after(stream, &c.fences);
        self.cached.fetch_sub(cap, Ordering::Relaxed);
        Some(c.mem)
    }
    pub(crate) fn put(&self, cap: usize, cached: Cached, ctx: &CudaContext, stream: &CudaStream) {
        let Cached {
            mem,
            fences,
            mut sends,
        } = cached;
        sends.retain(|e| !e.is_complete());
        // No event is queried while a graph is captured (see the module doc).
        let capturing = self.capturing.load(Ordering::Acquire);
        if !capturing {
            self.give_back_finished();
        }
        let over_limit = self.cached.load(Ordering::Relaxed) + cap > self.limit(ctx);
        if sends.is_empty() && (over_limit || self.to_driver(cap, &mem)) {
            self.count(1);
            let running = || fences.iter().any(|e| !e.is_complete());
            if !capturing && !mem.freed_at_once() && running() {
                // A collective still uses it: given back once the collective ends, so the
                // compute stream runs on meanwhile.
                lock(&self.deferred).push(Cached { mem, fences, sends });
                return;
            }
            // Freed on the compute stream, after the collectives that may still use it (NCCL
            // memory once the stream got there; driver memory in stream order, to the device's
            // pool, which hands its bytes out again only to work queued after this point).
            order_after(stream, &fences);
            if mem.freed_at_once() {
                let _ = stream.synchronize();
            }
            return;
        }
        self.cached.fetch_add(cap, Ordering::Relaxed);
        lock(&self.free)
            .entry(cap)
            .or_default()
            .push(Cached { mem, fences, sends });
    }
    /// Gives back the deferred blocks whose collectives have ended, in stream order (their
    /// memory is driver memory, freed on the compute stream: no wait, the collectives are
    /// done).
    fn give_back_finished(&self) {
        let done: Vec<Cached> = {
            let mut deferred = lock(&self.deferred);
            if deferred.is_empty() {
                return;
            }
            let (done, busy) = std::mem::take(&mut *deferred)
                .into_iter()
                .partition(|c| c.fences.iter().all(|e| e.is_complete()));
            *deferred = busy;
            done
        };
        drop(done);
    }
    /// Gives every cached block back (an out-of-memory's full release, counted as one).
    pub(crate) fn release_all(&self, stream: &CudaStream) {
        self.count(2);
        self.give_back_cached(stream);
    }
    /// Gives every cached block no send may still read back, in stream order.
    pub(crate) fn give_back_cached(&self, stream: &CudaStream) {
        let mut all: Vec<Cached> = Vec::new();
        let mut kept = 0;
        for (cap, list) in lock(&self.free).iter_mut() {
            for mut c in std::mem::take(list) {
                if c.sending() {
                    kept += *cap;
                    list.push(c);
                } else {
                    all.push(c);
                }
            }
        }
        all.append(&mut lock(&self.deferred));
        for c in &all {
            order_after(stream, &c.fences);
        }
        if all.iter().any(|c| c.mem.freed_at_once()) {
            let _ = stream.synchronize();
        }
        drop(all);
        self.cached.store(kept, Ordering::Relaxed);
    }
    /// Whether new blocks come from NCCL's allocator; a change gives the cached blocks back.
    pub(crate) fn set_nccl(&self, on: bool, stream: &CudaStream) {
        if self.nccl.swap(on, Ordering::AcqRel) != on {
            self.release_all(stream);
        }
    }
    pub(crate) fn nccl(&self) -> bool {
        self.nccl.load(Ordering::Acquire)
    }
    /// A new block of `cap` bytes from NCCL's allocator; under `SLAB` bytes, one of the blocks
    /// carved from a new slab (the others go to the free list).
    pub(crate) fn nccl_block(&self, cap: usize) -> std::result::Result<Memory, String> {
        let m = Arc::new(NcclMemory::alloc(cap.max(SLAB)).map_err(|e| e.to_string())?);
        if cap >= SLAB {
            return Ok(Memory::Nccl(m, 0));
        }
        let n = SLAB / cap;
        let mut g = lock(&self.free);
        let list = g.entry(cap).or_default();
        for i in 1..n {
            list.push(Cached {
                mem: Memory::Nccl(m.clone(), i * cap),
                fences: Vec::new(),
                sends: Vec::new(),
            });
        }
        self.cached.fetch_add((n - 1) * cap, Ordering::Relaxed);
        Ok(Memory::Nccl(m, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets() {
        assert_eq!(bucket(0), 512);
        assert_eq!(bucket(513), 1024);
        assert_eq!(bucket(1 << 20), 1 << 20);
        assert_eq!(bucket((1 << 20) + 1), (1 << 20) + (128 << 10));
        assert_eq!(bucket(768 * 768 * 4), 768 * 768 * 4);
        assert_eq!(bucket((5 << 20) + 3), (5 << 20) + (128 << 10));
        assert_eq!(bucket(32 << 20), 32 << 20);
        assert_eq!(bucket((32 << 20) + 1), 34 << 20);
        // Never more than an eighth over above 1 MiB.
        for b in [
            (1 << 20) + 1,
            3 << 20,
            (20 << 20) + 7,
            (33 << 20) + 5,
            1 << 30,
        ] {
            assert!(bucket(b) >= b && bucket(b) - b <= b / 8, "{b}");
        }
    }
}
