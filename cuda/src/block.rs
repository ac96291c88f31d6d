//! `Block`: one device allocation of the runtime's caching pool (`alloc`), back to the pool on
//! drop, or a view of part of another block (an arena's); it carries the end events of the
//! collectives that touched it, which the compute stream waits for before it next uses the
//! block (see `alloc`'s module doc), and a bf16 copy of its f32 elements when a product made one.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaEvent;
use oxiflow_collectives::DeviceFence;
use oxiflow_tensor::Result;

use crate::alloc::{bucket, lock, order_after, Cached, GraphMemory, Memory, SyncMemory};
use crate::error::derr;
use crate::runtime::CudaRuntime;

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
    pub fn alloc(rt: &Arc<CudaRuntime>, bytes: usize) -> Result<Block> {
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
                        // Out of memory: give the cached blocks and the driver pool's unused
                        // bytes back, and try once more.
                        rt.pool.count(2);
                        rt.release_cached_memory()?;
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
        oxiflow_tensor::memory::device_alloc(cap);
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
    pub fn ptr(&self) -> u64 {
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
            oxiflow_tensor::memory::device_free(self.cap);
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
            self.rt
                .pool
                .put(self.cap, cached, &self.rt.ctx, &self.rt.stream);
        }
    }
}
