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

/// The bucket of a request: powers of two up to 1 MiB, then multiples of 2 MiB.
fn bucket(bytes: usize) -> usize {
    let b = bytes.max(512);
    if b <= 1 << 20 {
        b.next_power_of_two()
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
}

impl Memory {
    fn ptr(&self, stream: &CudaStream) -> u64 {
        match self {
            Memory::Driver(s) => s.device_ptr(stream).0,
            Memory::Nccl(m, off) => m.ptr() + *off as u64,
        }
    }
    fn is_nccl(&self) -> bool {
        matches!(self, Memory::Nccl(..))
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
    /// A free block of `cap` bytes that `stream` may use now: an idle one, else (with
    /// `MAX_IN_FLIGHT` busy ones waiting) the oldest no send may still read, after `stream`
    /// waits for its collectives.
    fn take(&self, cap: usize, stream: &CudaStream) -> Option<Memory> {
        let mut g = lock(&self.free);
        let list = g.get_mut(&cap)?;
        let pick = match list.iter_mut().position(Cached::idle) {
            Some(i) => i,
            None if list.len() >= MAX_IN_FLIGHT => list.iter_mut().position(|c| !c.sending())?,
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
            if mem.is_nccl() {
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
        if all.iter().any(|c| c.mem.is_nccl()) {
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
        let mem = match rt.pool.take(cap, &rt.stream) {
            Some(s) => s,
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
        })
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
        sends.retain(|e| !e.is_complete());
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
    }
    fn after_send(&self, done: &Arc<CudaEvent>) {
        lock(&self.sends).push(done.clone());
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
        assert_eq!(bucket((1 << 20) + 1), 2 << 20);
        assert_eq!(bucket((5 << 20) + 3), 6 << 20);
    }
}
