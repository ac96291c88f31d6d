//! CUDA storage and kernels for the tensor crate: a per-device runtime (context, compute
//! stream, caching allocator, cuBLAS handle, NVRTC kernels made ready once per process:
//! embedded at build time when the build was asked for them, else cached or compiled),
//! `CudaStorage` behind the device seam, the `CudaBackend` that runs every dispatched op on
//! device pieces, and `CudaPiece`, the boxing executor's local piece on CUDA memory.
//!
//! One device per process: the runtime is bound once (`init_cuda`, or `init_cuda_on` with the
//! NCCL communicator's context) and every `Device::Cuda(_)` request of this process maps to
//! it. CUDA libraries are found through `collectives::cuda_libs` before cudarc touches them,
//! so a missing library is a typed error, never a panic. Kernels launch on the runtime's
//! compute stream; an `NcclComm` given that stream (`set_compute_stream`) orders its
//! collectives after them, and blocks touched by a collective carry its end event, which the
//! compute stream waits for before it next uses them (see `alloc`): no host synchronisation,
//! and a kernel that does not use a collective's buffers overlaps it.

mod alloc;
pub(crate) mod attention;
mod backend;
pub(crate) mod blaslt;
mod boxing;
mod build_times;
mod copy;
mod copy_many;
mod create;
pub(crate) mod cudnn_attention;
mod embedded_kernels;
pub(crate) mod flash_attention;
pub(crate) mod fused;
pub(crate) mod fused_elementwise;
pub(crate) mod graph;
mod kernel_cache;
mod kernel_check;
mod kernels;
mod library_sources;
mod nvrtc_compile;
mod nvrtc_module;
#[cfg(test)]
mod nvrtc_open;
mod ops;
mod piece;
mod precision;
pub(crate) mod raw;
mod storage;
mod timing;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream};
use oxiflow_collectives::cuda_libs::{self, LibSearch};
use oxiflow_placement::DeviceType;

use crate::device::register_device_backend;
use crate::executor::register_op_executor;
use crate::{Result, TensorError};

pub use attention::fused_attention_report;
pub use backend::CudaBackend;
pub use build_times::{kernel_builds, KernelBuild, KernelOrigin};
pub use embedded_kernels::embedded_kernel_archs;
pub use fused_elementwise::{prebuild_fused_elementwise, FusedCall};
pub use kernel_check::{run_kernel_checks, CheckOptions};
pub use kernels::philox_words_device;
pub use nvrtc_module::{CudaSource, KernelIds};
pub use ops::CudaKernels;
pub use piece::CudaPiece;
pub use precision::MatmulPrecision;
pub use storage::CudaStorage;
pub use timing::{op_timings, reset_op_timings, set_op_timing};

pub(crate) use alloc::Pool;
pub use alloc::{AllocCounts, Block};
pub(crate) use kernels::Kernels;

/// A typed device error naming `op` (what a CUDA kernel reports a launch failure as).
pub fn device_error(op: &'static str, detail: impl std::fmt::Display) -> TensorError {
    derr(op, detail)
}

/// A typed device error naming `op`.
pub(crate) fn derr(op: &'static str, detail: impl std::fmt::Display) -> TensorError {
    TensorError::Device {
        op,
        devices: "cuda".into(),
        shapes: String::new(),
        detail: detail.to_string(),
    }
}

/// Everything one process needs on its CUDA device.
pub struct CudaRuntime {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Mutex<Option<CudaBlas>>,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
    pool: Pool,
    /// How f32 matrix products run (`MatmulPrecision::code`).
    matmul_precision: AtomicU8,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaRuntime(cuda:{})", self.ordinal)
    }
}

static RUNTIME: Mutex<Option<Arc<CudaRuntime>>> = Mutex::new(None);

impl CudaRuntime {
    fn new(ctx: Arc<CudaContext>) -> Result<Arc<CudaRuntime>> {
        // OxiFlow orders its one compute stream itself; cudarc's per-slice events would add
        // host waits. SAFETY: no slice of this context object exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| derr("cuda init", format!("new stream: {e}")))?;
        Ok(Arc::new(CudaRuntime {
            ordinal: ctx.ordinal(),
            ctx,
            stream,
            blas: Mutex::new(None),
            kernels: OnceLock::new(),
            pool: Pool::default(),
            matmul_precision: AtomicU8::new(0),
        }))
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
    pub(crate) fn bind(&self, op: &'static str) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| derr(op, format!("binding cuda:{}: {e}", self.ordinal)))
    }
    /// The NVRTC kernels (compiled on first use, once per process).
    pub(crate) fn kernels(&self, op: &'static str) -> Result<&Kernels> {
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
    /// How f32 matrix products run from now on, in this process.
    pub fn set_matmul_precision(&self, p: MatmulPrecision) {
        self.matmul_precision.store(p.code(), Ordering::Relaxed);
    }
    /// How f32 matrix products run.
    pub fn matmul_precision(&self) -> MatmulPrecision {
        MatmulPrecision::from_code(self.matmul_precision.load(Ordering::Relaxed))
    }
    /// Whether new device blocks come from NCCL's allocator, which collectives register for
    /// zero-copy transfers (on in an NCCL world, set by `init_from_env`). NCCL requires both
    /// sides of a transfer to agree, so every rank must choose the same; a change gives the
    /// cached blocks back.
    pub fn set_nccl_memory(&self, on: bool) {
        self.pool.set_nccl(on, self);
    }
    /// Whether new device blocks come from NCCL's allocator.
    pub fn nccl_memory(&self) -> bool {
        self.pool.nccl()
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

fn install(rt: Arc<CudaRuntime>) -> Result<Arc<CudaRuntime>> {
    let mut g = RUNTIME.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(old) = g.as_ref() {
        if old.ordinal != rt.ordinal {
            return Err(derr(
                "cuda init",
                format!(
                    "this process is bound to cuda:{} and cannot also bind cuda:{}",
                    old.ordinal, rt.ordinal
                ),
            ));
        }
        return Ok(old.clone());
    }
    // Compile the kernels and create the cuBLAS handle now, so errors surface at start-up and
    // no op pays for them; the other sources build meanwhile, in the background.
    build_times::start_background_builds(&rt);
    rt.kernels("cuda init")?;
    rt.with_blas("cuda init", |_| Ok(()))?;
    *g = Some(rt.clone());
    register_device_backend(DeviceType::Cuda, Arc::new(CudaBackend))?;
    register_op_executor(DeviceType::Cuda, Arc::new(CudaBackend))?;
    Ok(rt)
}

/// Binds this process to CUDA device `ordinal` and registers the CUDA backend. Idempotent for
/// the same ordinal; a missing driver or device is a typed error.
pub fn init_cuda(ordinal: usize) -> Result<Arc<CudaRuntime>> {
    if let Some(rt) = bound_runtime() {
        if rt.ordinal == ordinal {
            return Ok(rt);
        }
    }
    let libs = LibSearch::default();
    cuda_libs::ensure_driver(&libs).map_err(|e| derr("cuda init", e))?;
    let n = cuda_libs::device_count(&libs).map_err(|e| derr("cuda init", e))?;
    if ordinal >= n {
        return Err(derr(
            "cuda init",
            format!("device {ordinal} requested, {n} CUDA device(s) visible"),
        ));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| derr("cuda init", e))?;
    install(CudaRuntime::new(ctx)?)
}

/// Binds this process to the device of `ctx` (e.g. an `NcclComm`'s context).
pub fn init_cuda_on(ctx: Arc<CudaContext>) -> Result<Arc<CudaRuntime>> {
    if let Some(rt) = bound_runtime() {
        if rt.ordinal == ctx.ordinal() {
            return Ok(rt);
        }
    }
    install(CudaRuntime::new(ctx)?)
}

/// The runtime this process is bound to, if any.
pub fn bound_runtime() -> Option<Arc<CudaRuntime>> {
    RUNTIME.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The bound runtime or a typed error naming `op`.
pub(crate) fn runtime(op: &'static str) -> Result<Arc<CudaRuntime>> {
    bound_runtime().ok_or_else(|| derr(op, "no CUDA device bound in this process (init_cuda)"))
}
