//! `CudaRuntime`, everything one process needs on its CUDA device (context, compute stream,
//! cuBLAS handle, NVRTC kernels, the caching pool), and the process's bound runtime.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream};
use oxiflow_collectives::cuda_libs::{self, LibSearch};
use oxiflow_tensor::Result;

use crate::alloc::{AllocCounts, Pool};
use crate::error::derr;
use crate::kernels::Kernels;

/// Everything one process needs on its CUDA device.
pub struct CudaRuntime {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    blas: Mutex<Option<CudaBlas>>,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
    pub(crate) pool: Pool,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaRuntime(cuda:{})", self.ordinal)
    }
}

/// Blocks of at least this many bytes go back to the device's stream-ordered pool when freed
/// (see [`CudaRuntime::set_driver_reuse_from`]).
pub const DRIVER_REUSE_FROM: usize = 4 << 20;

/// The runtime this process is bound to (set once by `init::install`).
pub(crate) static RUNTIME: Mutex<Option<Arc<CudaRuntime>>> = Mutex::new(None);

impl CudaRuntime {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Result<Arc<CudaRuntime>> {
        // OxiFlow orders its one compute stream itself; cudarc's per-slice events would add
        // host waits. SAFETY: no slice of this context object exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| derr("cuda init", format!("new stream: {e}")))?;
        let rt = Arc::new(CudaRuntime {
            ordinal: ctx.ordinal(),
            ctx,
            stream,
            blas: Mutex::new(None),
            kernels: OnceLock::new(),
            pool: Pool::default(),
        });
        if rt.ctx.has_async_alloc() {
            rt.set_driver_reuse_from(Some(DRIVER_REUSE_FROM))?;
        }
        Ok(rt)
    }
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every kernel and copy of this runtime runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// A launch of `f` on the compute stream, with this device current on the calling thread:
    /// push the kernel's arguments in order (`PushKernelArg::arg`), then `launch` it (unsafe:
    /// the arguments must match the kernel's parameters, every pointer a live allocation
    /// covering what the kernel indexes).
    pub fn launcher<'a>(
        &'a self,
        op: &'static str,
        f: &'a cudarc::driver::CudaFunction,
    ) -> Result<cudarc::driver::LaunchArgs<'a>> {
        self.bind(op)?;
        Ok(self.stream.launch_builder(f))
    }
    /// Makes this device current on the calling thread.
    pub fn bind(&self, op: &'static str) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| derr(op, format!("binding cuda:{}: {e}", self.ordinal)))
    }
    /// The NVRTC kernels (compiled on first use, once per process).
    pub fn kernels(&self, op: &'static str) -> Result<&Kernels> {
        let k = self
            .kernels
            .get_or_init(|| Kernels::compile(&self.ctx).map_err(|e| e.to_string()));
        k.as_ref().map_err(|e| derr(op, e))
    }
    /// Runs `f` with the cuBLAS handle (created on first use, on the compute stream).
    pub(crate) fn with_blas<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&CudaBlas) -> Result<R>,
    ) -> Result<R> {
        let mut g = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            cuda_libs::ensure_cublas(&LibSearch::default()).map_err(|e| derr(op, e))?;
            let b =
                CudaBlas::new(self.stream.clone()).map_err(|e| derr(op, format!("cuBLAS: {e}")))?;
            *g = Some(b);
        }
        match g.as_ref() {
            Some(b) => f(b),
            None => Err(derr(op, "cuBLAS handle missing")),
        }
    }
    /// Waits for everything queued on this device: the compute stream and the collectives
    /// still running on comm streams (their watchdogs abort a collective that hangs, which
    /// ends this wait with an error).
    pub fn synchronize(&self) -> Result<()> {
        self.bind("cuda synchronize")?;
        self.stream
            .synchronize()
            .and_then(|_| self.ctx.synchronize())
            .map_err(|e| derr("cuda synchronize", e))
    }
    /// Whether new device blocks come from NCCL's allocator, which collectives register for
    /// zero-copy transfers (on in an NCCL world, set by `init_from_env`). NCCL requires both
    /// sides of a transfer to agree, so every rank must choose the same; a change gives the
    /// cached blocks back.
    pub fn set_nccl_memory(&self, on: bool) {
        self.pool.set_nccl(on, &self.stream);
    }
    /// Whether new device blocks come from NCCL's allocator.
    pub fn nccl_memory(&self) -> bool {
        self.pool.nccl()
    }
    /// Device blocks of at least `from` bytes go back to the device's stream-ordered pool when
    /// freed (which serves any size from their bytes) instead of to the allocator's per-size
    /// free lists; None: every block is cached by size. The default is
    /// [`DRIVER_REUSE_FROM`] where the device has that pool.
    pub fn set_driver_reuse_from(&self, from: Option<usize>) -> Result<()> {
        self.bind("cuda driver pool")?;
        self.pool
            .set_driver_from(from, &self.ctx, &self.stream)
            .map_err(|e| derr("cuda driver pool", format!("cuda:{}: {e}", self.ordinal)))
    }
    /// Gives the allocator's cached blocks and the bytes the device's stream-ordered pool holds
    /// unused back to the driver, after the compute stream synchronised (blocks a send may
    /// still read stay). Before one large allocation (a compiled program's arena), so the
    /// driver serves it from those bytes instead of beside them. Nothing while a graph is
    /// captured (the capture would be invalidated).
    pub fn release_cached_memory(&self) -> Result<()> {
        if self
            .pool
            .capturing
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Ok(());
        }
        self.bind("cuda release cached memory")?;
        self.pool.give_back_cached(&self.stream);
        self.synchronize()?;
        // A failed trim leaves the bytes to the pool's own reuse.
        let _ = super::driver_pool::trim(&self.ctx);
        Ok(())
    }
    /// The most bytes the device's stream-ordered pool ever reserved (None: not known).
    pub fn driver_pool_peak(&self) -> Option<usize> {
        self.bind("cuda driver pool").ok()?;
        super::driver_pool::reserved_high(&self.ctx)
    }
    /// Bytes held in the allocator's free lists.
    pub fn cached_bytes(&self) -> usize {
        self.pool.cached_bytes()
    }
    /// How often the allocator went to the driver since the process started.
    pub fn alloc_counts(&self) -> AllocCounts {
        self.pool.counts()
    }
    /// (free, total) bytes of this device's memory as the driver reports them now (the
    /// allocator's cached blocks count as used).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind("cuda memory_info")?;
        cudarc::driver::result::mem_get_info().map_err(|e| derr("cuda memory_info", e))
    }
}

/// Why CUDA cannot be used in this process (`None`: a driver and at least one device exist).
pub fn cuda_unavailable() -> Option<String> {
    match cuda_libs::device_count(&LibSearch::default()) {
        Ok(0) => Some("no CUDA device visible".into()),
        Ok(_) => None,
        Err(e) => Some(e),
    }
}

/// The runtime this process is bound to, if any.
pub fn bound_runtime() -> Option<Arc<CudaRuntime>> {
    RUNTIME.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The bound runtime or a typed error naming `op`.
pub(crate) fn runtime(op: &'static str) -> Result<Arc<CudaRuntime>> {
    bound_runtime().ok_or_else(|| derr(op, "no CUDA device bound in this process (init_cuda)"))
}
