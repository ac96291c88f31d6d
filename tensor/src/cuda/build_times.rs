//! How long this process spent making its kernels ready: each NVRTC source's compile to the
//! device's machine code (or its read from the kernel cache) and its load, and each cuDNN
//! attention plan build, in the order they finished. The runtime starts
//! building its NVRTC sources on several threads as soon as it is created
//! (`prebuild_kernels`), so a first step mostly finds them ready.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::kernel_cache::Origin;
use super::CudaRuntime;

/// One kernel source or plan made ready.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelBuild {
    /// The NVRTC source or cuDNN graph.
    pub what: String,
    /// Milliseconds to compile (NVRTC to the device's machine code, or reading it from the
    /// kernel cache; cuDNN: building the graph and its plan).
    pub compile_ms: f64,
    /// The machine code came from the on-disk kernel cache.
    pub cached: bool,
    /// Milliseconds to load the module.
    pub load_ms: f64,
    /// The thread was the background prebuild, not the op that first needed it.
    pub prebuilt: bool,
}

static BUILDS: Mutex<Vec<KernelBuild>> = Mutex::new(Vec::new());

thread_local! {
    static PREBUILDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Records a build from `origin` that compiled from `start` to `compiled`, then loaded until
/// now.
pub(crate) fn record(what: impl Into<String>, origin: Origin, start: Instant, compiled: Instant) {
    let b = KernelBuild {
        what: what.into(),
        compile_ms: (compiled - start).as_secs_f64() * 1e3,
        cached: origin == Origin::Cache,
        load_ms: compiled.elapsed().as_secs_f64() * 1e3,
        prebuilt: PREBUILDING.with(|p| p.get()),
    };
    BUILDS.lock().unwrap_or_else(|p| p.into_inner()).push(b);
}

/// Every kernel build of this process so far.
pub fn kernel_builds() -> Vec<KernelBuild> {
    BUILDS.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Starts compiling and loading the runtime's other NVRTC sources (the fused norm, AdamW and
/// classifier kernels, the one-read classifier, the multi-tensor sum of squares and copy; the
/// element-wise and layout kernels are built at start-up) on one thread each, in the
/// background. An op that needs a source before its thread is done waits for it; a failed build
/// is kept and reported by that op.
pub(crate) fn prebuild_kernels(rt: &Arc<CudaRuntime>) {
    let jobs: [fn(&CudaRuntime); 4] = [
        super::fused::prebuild,
        super::fused::prebuild_one_read,
        super::sum_squares::prebuild,
        super::copy_many::prebuild,
    ];
    for job in jobs {
        let rt = rt.clone();
        let spawned = std::thread::Builder::new()
            .name("oxiflow-kernels".into())
            .spawn(move || {
                PREBUILDING.with(|p| p.set(true));
                job(&rt);
            });
        // Without a thread the source is built by the first op that needs it.
        drop(spawned);
    }
}
