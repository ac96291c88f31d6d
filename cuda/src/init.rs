//! Binding this process to its CUDA device: the runtime installed once (its kernels and
//! cuBLAS handle made ready at start-up, the other sources built in the background) and the
//! CUDA backend registered with the tensor core's device and executor registries.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use oxiflow_collectives::cuda_libs::{self, LibSearch};
use oxiflow_placement::DeviceType;
use oxiflow_tensor::{register_device_backend, register_op_executor, Result};

use crate::backend::CudaBackend;
use crate::build_times::mark_background_thread;
use crate::error::derr;
use crate::runtime::{bound_runtime, CudaRuntime, RUNTIME};

/// Makes `rt` the process's runtime (or returns the one already bound to its device) and
/// registers the CUDA backend; binding a second device is a typed error.
fn install(rt: Arc<CudaRuntime>) -> Result<Arc<CudaRuntime>> {
    let mut g = RUNTIME.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(old) = g.as_ref() {
        if old.ordinal() != rt.ordinal() {
            return Err(derr(
                "cuda init",
                format!(
                    "this process is bound to cuda:{} and cannot also bind cuda:{}",
                    old.ordinal(),
                    rt.ordinal()
                ),
            ));
        }
        return Ok(old.clone());
    }
    // Compile the kernels and create the cuBLAS handle now, so errors surface at start-up and
    // no op pays for them; the other sources build meanwhile, in the background.
    start_background_builds(&rt);
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
        if rt.ordinal() == ordinal {
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
        if rt.ordinal() == ctx.ordinal() {
            return Ok(rt);
        }
    }
    install(CudaRuntime::new(ctx)?)
}

/// Starts making the runtime's other NVRTC sources ready (the fused norm, AdamW and classifier
/// kernels, the one-read classifier, the multi-range copy; the element-wise
/// and layout kernels are made ready at start-up), cuDNN's library and handle and cuBLASLt's
/// handle and heuristics, on one thread each, in the background. An op
/// that needs a source before its thread is done waits for it; a failed build is kept and
/// reported by that op. The threads are kept for [`finish_background_builds`].
/// The start-up background threads not yet waited for.
static BACKGROUND: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// Waits up to `timeout` in all for the start-up background builds (cuDNN's and cuBLASLt's
/// libraries and handles, the NVRTC sources: see `start_background_builds`) to finish, and
/// returns whether they all did. A process must not exit while one of them is inside one of
/// those libraries: the libraries' exit-time teardown would run under it (a crash at exit,
/// typically of a short run that never needed the library the thread was loading).
/// `oxiflow::trainer::main_with` calls it before it returns; a program of its own that binds
/// CUDA calls it before `main` ends. Without a runtime it returns true at once.
pub fn finish_background_builds(timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut threads = BACKGROUND.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let (done, running): (Vec<_>, Vec<_>) =
            threads.drain(..).partition(JoinHandle::is_finished);
        *threads = running;
        for t in done {
            // A build's failure is kept for the op that needs it; a panic here has no reader.
            let _ = t.join();
        }
        if threads.is_empty() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub(crate) fn start_background_builds(rt: &Arc<CudaRuntime>) {
    let jobs: [fn(&CudaRuntime); 5] = [
        crate::fused::build_module,
        crate::fused::build_one_read_module,
        crate::copy_many::build_module,
        crate::cudnn_attention::start_up,
        crate::blaslt::start_up,
    ];
    for job in jobs {
        let rt = rt.clone();
        let spawned = std::thread::Builder::new()
            .name("oxiflow-kernels".into())
            .spawn(move || {
                mark_background_thread();
                job(&rt);
            });
        // Without a thread the source is built by the first op that needs it.
        if let Ok(t) = spawned {
            BACKGROUND.lock().unwrap_or_else(|p| p.into_inner()).push(t);
        }
    }
}
