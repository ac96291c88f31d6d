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

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr as _};
use oxiflow_collectives::nccl::NcclMemory;
use oxiflow_collectives::DeviceFence;

use super::{derr, CudaRuntime};
use crate::Result;

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
fn bucket(bytes: usize) -> usize {
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes `stream` wait for `events` (a failed wait falls back to waiting on the host).
fn order_after(stream: &CudaStream, events: &[Arc<CudaEvent>]) {
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
enum Memory {
    /// `cuMemAllocAsync` on the compute stream (freed in stream order).
    Driver(CudaSlice<u8>),
    /// Bytes `offset..` of an NCCL allocation (shared by the blocks carved from one slab).
    Nccl(Arc<NcclMemory>, usize),
    /// `cuMemAlloc` (made while a graph was captured), freed at once when dropped.
    Sync(SyncMemory),
}

impl Memory {
    fn ptr(&self, stream: &CudaStream) -> u64 {
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
struct SyncMemory(u64);

impl SyncMemory {
    fn alloc(bytes: usize) -> std::result::Result<SyncMemory, String> {
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
    capturing: AtomicBool,
    /// Whether the graph lives (false: its blocks go back to the pool).
    live: AtomicBool,
    /// End events of the collectives captured (the compute stream joins them at the end).
    events: Mutex<Vec<Arc<CudaEvent>>>,
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
    fn take(&self, cap: usize, stream: &CudaStream) -> Option<Memory> {
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
    fn keep(&self, cap: usize, c: Cached) -> std::result::Result<(), Cached> {
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
struct Cached {
    mem: Memory,
    fences: Vec<Arc<CudaEvent>>,
    sends: Vec<Arc<CudaEvent>>,
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
    /// Driver allocations, blocks given back past the limit, and full releases (out of memory).
    counts: [AtomicUsize; 3],
    /// The graph being captured, if any (see the module doc).
    capture: Mutex<Option<Arc<GraphMemory>>>,
    /// Whether `capture` is set (read on every allocation and free).
    capturing: AtomicBool,
}

/// How often the pool went to the driver: `(allocations, blocks given back past the cache
/// limit, full releases after an out-of-memory)`, since the process started.
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
    fn count(&self, i: usize) {
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }
    fn limit(&self, rt: &CudaRuntime) -> usize {
        let l = self.limit.load(Ordering::Relaxed);
        if l != 0 {
            return l;
        }
        let total = rt
            .bind("cuda alloc")
            .ok()
            .and_then(|_| cudarc::driver::result::mem_get_info().ok())
            .map(|(_, total)| total);
        let l = cache_limit(total);
        self.limit.store(l, Ordering::Relaxed);
        l
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
    pub(crate) fn end_capture(&self, m: &Arc<GraphMemory>, keep: bool, rt: &CudaRuntime) {
        let mut g = lock(&self.capture);
        if g.as_ref().is_some_and(|c| Arc::ptr_eq(c, m)) {
            *g = None;
            self.capturing.store(false, Ordering::Release);
        }
        drop(g);
        m.capturing.store(false, Ordering::Release);
        if !keep {
            self.release_graph(m, rt);
        }
    }
    /// Gives the blocks of a graph that is gone back to the pool (its launches are ordered
    /// before any later work on the compute stream).
    pub(crate) fn release_graph(&self, m: &GraphMemory, rt: &CudaRuntime) {
        m.live.store(false, Ordering::Release);
        let kept = std::mem::take(&mut *lock(&m.kept));
        for (cap, list) in kept {
            for c in list {
                self.put(cap, c, rt);
            }
        }
    }
    /// A free block of `cap` bytes that `stream` may use now: an idle one, else (with
    /// `MAX_IN_FLIGHT` busy ones waiting, and `may_wait`) the oldest no send may still read,
    /// after `stream` waits for its collectives. While a graph is captured a stream may not
    /// wait for work queued before the capture (the capture would be invalidated), so only
    /// an idle block serves then.
    fn take(&self, cap: usize, stream: &CudaStream, may_wait: bool) -> Option<Memory> {
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
    fn put(&self, cap: usize, cached: Cached, rt: &CudaRuntime) {
        let Cached {
            mem,
            fences,
            mut sends,
        } = cached;
        sends.retain(|e| !e.is_complete());
        if sends.is_empty() && self.cached.load(Ordering::Relaxed) + cap > self.limit(rt) {
            self.count(1);
            // Freed on the compute stream, after the collectives that may still use it (NCCL
            // memory once the stream got there).
            order_after(&rt.stream, &fences);
            if mem.freed_at_once() {
                let _ = rt.stream.synchronize();
            }
            return;
        }
        self.cached.fetch_add(cap, Ordering::Relaxed);
        lock(&self.free)
            .entry(cap)
            .or_default()
            .push(Cached { mem, fences, sends });
    }
    fn release_all(&self, rt: &CudaRuntime) {
        self.count(2);
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
        for c in &all {
            order_after(&rt.stream, &c.fences);
        }
        if all.iter().any(|c| c.mem.freed_at_once()) {
            let _ = rt.stream.synchronize();
        }
        drop(all);
        self.cached.store(kept, Ordering::Relaxed);
    }
    /// Whether new blocks come from NCCL's allocator; a change gives the cached blocks back.
    pub(crate) fn set_nccl(&self, on: bool, rt: &CudaRuntime) {
        if self.nccl.swap(on, Ordering::AcqRel) != on {
            self.release_all(rt);
        }
    }
    pub(crate) fn nccl(&self) -> bool {
        self.nccl.load(Ordering::Acquire)
    }
    /// A new block of `cap` bytes from NCCL's allocator; under `SLAB` bytes, one of the blocks
    /// carved from a new slab (the others go to the free list).
    fn nccl_block(&self, cap: usize) -> std::result::Result<Memory, String> {
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

/// A block's bf16 copy of the f32 elements `(byte offset, count)` of it.
type Shadow = ((usize, usize), Box<Block>);

/// One device allocation of at least `bytes` bytes, back to the pool on drop; or a view of
/// `bytes` bytes at an offset of another block (an arena's), which frees nothing.
pub struct Block {
    mem: Option<Memory>,
    /// The block a view's bytes belong to (kept alive by the view).
    parent: Option<Arc<Block>>,
    ptr: u64,
    bytes: usize,
    cap: usize,
    rt: Arc<CudaRuntime>,
    /// End events of collectives on this block the compute stream has not waited for yet.
    fences: Mutex<Vec<Arc<CudaEvent>>>,
    /// End events of sends from this block (see `DeviceFence::after_send`).
    sends: Mutex<Vec<Arc<CudaEvent>>>,
    /// A bf16 copy of the f32 elements, made by the first bf16 matrix product that reads them.
    shadow: Mutex<Option<Shadow>>,
    /// The graph whose capture made or took the block (it keeps the block when freed).
    graph: Option<Arc<GraphMemory>>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Block({} of {} bytes on cuda:{})",
            self.bytes, self.cap, self.rt.ordinal
        )
    }
}

impl Block {
    /// An uninitialised block (the caller writes every byte it reads).
    pub(crate) fn alloc(rt: &Arc<CudaRuntime>, bytes: usize) -> Result<Block> {
        let cap = bucket(bytes);
        let graph = rt.pool.capture();
        let reused = match &graph {
            Some(g) => g.take(cap, &rt.stream),
            None => None,
        };
        let mem = match reused.or_else(|| rt.pool.take(cap, &rt.stream, graph.is_none())) {
            Some(s) => s,
            None if graph.is_some() => {
                rt.bind("cuda alloc")?;
                rt.pool.count(0);
                Memory::Sync(SyncMemory::alloc(cap).map_err(|e| {
                    derr(
                        "cuda alloc",
                        format!(
                            "{bytes} bytes on cuda:{} while capturing a graph: {e}",
                            rt.ordinal
                        ),
                    )
                })?)
            }
            None => {
                rt.bind("cuda alloc")?;
                match fresh(rt, cap) {
                    Ok(s) => s,
                    Err(_) => {
                        // Out of memory: give the cached blocks back and try once more.
                        rt.pool.release_all(rt);
                        rt.synchronize()?;
                        fresh(rt, cap).map_err(|e| {
                            derr(
                                "cuda alloc",
                                format!("{bytes} bytes on cuda:{}: {e}", rt.ordinal),
                            )
                        })?
                    }
                }
            }
        };
        let ptr = mem.ptr(&rt.stream);
        crate::memory::device_alloc(cap);
        Ok(Block {
            mem: Some(mem),
            parent: None,
            ptr,
            bytes,
            cap,
            rt: rt.clone(),
            fences: Mutex::new(Vec::new()),
            sends: Mutex::new(Vec::new()),
            shadow: Mutex::new(None),
            graph,
        })
    }
    /// Whether collectives touched the block since the compute stream last waited for them
    /// (see [`Block::ptr`]).
    pub(crate) fn awaits_collectives(&self) -> bool {
        !lock(&self.fences).is_empty()
    }
    /// The address, for work queued on the compute stream next: the stream first waits for
    /// the collectives that touched the block since it last did (and for sends from it still
    /// running, which the one-way transfers never let happen: they drop their send buffers).
    pub(crate) fn ptr(&self) -> u64 {
        let mut f = lock(&self.fences);
        if !f.is_empty() {
            order_after(&self.rt.stream, &f);
            f.clear();
        }
        let mut sends = lock(&self.sends);
        if !self.rt.pool.capturing.load(Ordering::Acquire) {
            sends.retain(|e| !e.is_complete());
        }
        if !sends.is_empty() {
            order_after(&self.rt.stream, &sends);
            sends.clear();
        }
        self.ptr
    }
    pub(crate) fn runtime(&self) -> &Arc<CudaRuntime> {
        &self.rt
    }
    /// A view of `bytes` bytes at `offset` of `parent` (inside it: checked here). The view
    /// carries its own fences: when it goes, the compute stream waits for the collectives and
    /// sends that used it, so whatever is placed at these bytes next is written after them.
    pub(crate) fn view(parent: &Arc<Block>, offset: usize, bytes: usize) -> Result<Block> {
        if offset.checked_add(bytes).is_none_or(|e| e > parent.bytes) {
            return Err(derr(
                "arena",
                format!(
                    "{bytes} bytes at {offset} do not fit a block of {}",
                    parent.bytes
                ),
            ));
        }
        Ok(Block {
            mem: None,
            parent: Some(parent.clone()),
            ptr: parent.ptr + offset as u64,
            bytes,
            cap: 0,
            rt: parent.rt.clone(),
            fences: Mutex::new(Vec::new()),
            sends: Mutex::new(Vec::new()),
            shadow: Mutex::new(None),
            graph: None,
        })
    }
    /// Gives this block the bf16 copy `b` of its f32 elements (written by the kernel that wrote
    /// the block).
    pub(crate) fn set_bf16_shadow(&self, b: Block) {
        *lock(&self.shadow) = Some(((0, self.bytes / 4), Box::new(b)));
    }
    /// The address of the bf16 copy of this block's `n` f32 elements from byte `offset` on,
    /// made by `make` on first use (a copy of another range is replaced: the block keeps one).
    /// Blocks are immutable once a piece holds them; a collective that touches the block drops
    /// the copy.
    pub(crate) fn bf16_shadow(
        &self,
        offset: usize,
        n: usize,
        make: impl FnOnce() -> Result<Block>,
    ) -> Result<u64> {
        let mut g = lock(&self.shadow);
        if g.as_ref().is_none_or(|(at, _)| *at != (offset, n)) {
            *g = Some(((offset, n), Box::new(make()?)));
        }
        match g.as_ref() {
            Some((_, b)) => Ok(b.ptr()),
            None => Err(derr("bf16 copy", "missing after creation")),
        }
    }
}

/// A new allocation of `cap` bytes from the pool's source (the runtime's context is bound).
fn fresh(rt: &CudaRuntime, cap: usize) -> std::result::Result<Memory, String> {
    rt.pool.count(0);
    if rt.pool.nccl() {
        return rt.pool.nccl_block(cap);
    }
    // SAFETY: memory is written before it is read (callers' contract).
    unsafe { rt.stream.alloc::<u8>(cap) }
        .map(Memory::Driver)
        .map_err(|e| e.to_string())
}

impl DeviceFence for Block {
    fn after_collective(&self, done: &Arc<CudaEvent>) {
        lock(&self.shadow).take();
        lock(&self.fences).push(done.clone());
        if let Some(g) = self.rt.pool.capture() {
            lock(&g.events).push(done.clone());
        }
    }
    fn after_send(&self, done: &Arc<CudaEvent>) {
        lock(&self.sends).push(done.clone());
        if let Some(g) = self.rt.pool.capture() {
            lock(&g.events).push(done.clone());
        }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if self.parent.is_some() {
            let pending: Vec<Arc<CudaEvent>> = std::mem::take(&mut *lock(&self.fences))
                .into_iter()
                .chain(std::mem::take(&mut *lock(&self.sends)))
                .collect();
            order_after(&self.rt.stream, &pending);
            return;
        }
        if let Some(s) = self.mem.take() {
            crate::memory::device_free(self.cap);
            let cached = Cached {
                mem: s,
                fences: std::mem::take(&mut *lock(&self.fences)),
                sends: std::mem::take(&mut *lock(&self.sends)),
            };
            // A block a graph's kernels use stays the graph's: the one that made it, else the
            // one being captured now (its kernels may read the block).
            let graph = self.graph.take().or_else(|| self.rt.pool.capture());
            let cached = match graph {
                Some(g) => match g.keep(self.cap, cached) {
                    Ok(()) => return,
                    Err(c) => c,
                },
                None => cached,
            };
            self.rt.pool.put(self.cap, cached, &self.rt);
        }
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
