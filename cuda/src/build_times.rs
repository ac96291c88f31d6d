//! How long this process spent making its kernels ready: each NVRTC source's machine code
//! (embedded in the binary at build time, read from the kernel cache, or compiled now) and its
//! load, and each cuDNN attention plan build, in the order they finished. The runtime starts
//! making its NVRTC sources ready on several background threads as soon as it is created
//! (`init::start_background_builds`), so a first step mostly finds them ready.

use std::sync::Mutex;
use std::time::Instant;

/// Where a source's machine code came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelOrigin {
    /// Compiled when the binary was built (`OXIFLOW_PREBUILD_ARCHS`) and embedded in it.
    Embedded,
    /// Read from the on-disk kernel cache.
    DiskCache,
    /// Compiled in this process (NVRTC; for cuDNN, the graph and its plan built).
    Compiled,
}

impl std::fmt::Display for KernelOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KernelOrigin::Embedded => "embedded at build time",
            KernelOrigin::DiskCache => "from the kernel cache",
            KernelOrigin::Compiled => "compiled",
        })
    }
}

/// One kernel source or plan made ready.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelBuild {
    /// The NVRTC source or cuDNN graph.
    pub what: String,
    /// Where its machine code came from.
    pub origin: KernelOrigin,
    /// Milliseconds to get the machine code (finding the embedded image, reading the kernel
    /// cache, or compiling; cuDNN: building the graph and its plan).
    pub compile_ms: f64,
    /// Milliseconds to load the module.
    pub load_ms: f64,
    /// Made ready by a start-up background thread, not by the op that first needed it.
    pub background: bool,
    /// When getting the machine code began (a caller's own clock gives the offset).
    pub started_at: Instant,
}

static BUILDS: Mutex<Vec<KernelBuild>> = Mutex::new(Vec::new());

thread_local! {
    static IN_BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread's builds as made in the background ([`KernelBuild::background`]).
pub(crate) fn mark_background_thread() {
    IN_BACKGROUND.with(|p| p.set(true));
}

/// Records a build from `origin` that compiled from `start` to `compiled`, then loaded until
/// now.
pub(crate) fn record(
    what: impl Into<String>,
    origin: KernelOrigin,
    start: Instant,
    compiled: Instant,
) {
    let b = KernelBuild {
        what: what.into(),
        origin,
        compile_ms: (compiled - start).as_secs_f64() * 1e3,
        load_ms: compiled.elapsed().as_secs_f64() * 1e3,
        background: IN_BACKGROUND.with(|p| p.get()),
        started_at: start,
    };
    BUILDS.lock().unwrap_or_else(|p| p.into_inner()).push(b);
}

/// Records a build that this process compiled from `start` until now ([`KernelOrigin::Compiled`]).
pub(crate) fn record_compiled(what: impl Into<String>, start: Instant) {
    record(what, KernelOrigin::Compiled, start, Instant::now());
}

/// Every kernel build of this process so far.
pub fn kernel_builds() -> Vec<KernelBuild> {
    BUILDS.lock().unwrap_or_else(|p| p.into_inner()).clone()
}
