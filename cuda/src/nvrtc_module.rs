//! A CUDA source of the raw layer made ready once per process as machine code for the device's
//! own architecture (`sm_XY`, so `mma`/`ldmatrix`-era instructions and the device's intrinsics
//! are available): the image embedded at build time when this build has one for exactly that
//! source and architecture (`embedded_kernels`), else the on-disk kernel cache's, else NVRTC's;
//! with its kernels looked up once by name.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::build_times::{record, KernelOrigin};
use super::embedded_kernels::{find, EMBEDDED};
use super::kernel_cache;
use super::library_sources::{nvrtc_options, LibrarySource};
use super::raw::{FResult, FusedError};

/// The kernels of one compiled source.
pub(crate) struct Module {
    funcs: HashMap<String, CudaFunction>,
    _module: Arc<CudaModule>,
}

// SAFETY: CudaFunction and CudaModule hold driver handles that the CUDA driver allows any
// thread to use; cudarc marks them Send + Sync already, this asserts it for the map.
unsafe impl Sync for Module {}

/// The device's architecture name `sm_XY` (made once per process).
fn arch(ctx: &Arc<CudaContext>) -> Result<&'static str, String> {
    static ARCH: OnceLock<&'static str> = OnceLock::new();
    if let Some(a) = ARCH.get() {
        return Ok(a);
    }
    let (maj, min) = ctx
        .compute_capability()
        .map_err(|e| format!("reading the compute capability: {e}"))?;
    let name: &'static str = Box::leak(format!("sm_{maj}{min}").into_boxed_str());
    Ok(ARCH.get_or_init(|| name))
}

/// Loads `source` (named `what` in [`super::kernel_builds`]) on `ctx` as machine code for the
/// device: the embedded image, else the kernel cache's, else compiled by NVRTC. An embedded
/// image that does not unpack or that the driver refuses (a driver older than the CUDA that
/// made it), or a cached one it refuses (a damaged file), is compiled again.
pub(crate) fn load_source(
    ctx: &Arc<CudaContext>,
    what: &str,
    source: &str,
) -> Result<Arc<CudaModule>, String> {
    let options = nvrtc_options(arch(ctx)?);
    let start = Instant::now();
    if let Some(Ok(image)) = find(EMBEDDED, source, &options).map(|e| e.image()) {
        let found = Instant::now();
        if let Ok(m) = ctx.load_module(Ptx::from_binary(image)) {
            record(what, KernelOrigin::Embedded, start, found);
            return Ok(m);
        }
    }
    let (image, origin) = kernel_cache::cubin(source, &options)?;
    let compiled = Instant::now();
    let module = match (ctx.load_module(Ptx::from_binary(image)), origin) {
        (Ok(m), _) => m,
        (Err(_), KernelOrigin::DiskCache) => ctx
            .load_module(Ptx::from_binary(kernel_cache::recompile(source, &options)?))
            .map_err(|e| format!("loading the module: {e}"))?,
        (Err(e), _) => return Err(format!("loading the module: {e}")),
    };
    record(what, origin, start, compiled);
    Ok(module)
}

impl Module {
    /// Loads `source` (named `what` in [`super::kernel_builds`], see [`load_source`]) and looks
    /// up its kernels `names`.
    pub(crate) fn compile(
        ctx: &Arc<CudaContext>,
        what: &str,
        source: &str,
        names: &[String],
    ) -> Result<Module, String> {
        let module = load_source(ctx, what, source)?;
        let mut funcs = HashMap::new();
        for n in names {
            let f = module
                .load_function(n)
                .map_err(|e| format!("kernel {n}: {e}"))?;
            funcs.insert(n.clone(), f);
        }
        Ok(Module {
            funcs,
            _module: module,
        })
    }

    /// The kernel `name`.
    pub(crate) fn get(&self, op: &'static str, name: &str) -> FResult<&CudaFunction> {
        self.funcs.get(name).ok_or_else(|| FusedError::Invalid {
            op,
            detail: format!("no kernel {name} in the module"),
        })
    }
}

/// The module in `cell` of the library's `source`, made ready on first use (a failure is kept
/// and reported again, to `op`), with its kernels `names`.
pub(crate) fn module<'a>(
    cell: &'a OnceLock<Result<Module, String>>,
    ctx: &Arc<CudaContext>,
    op: &'static str,
    source: &LibrarySource,
    names: impl FnOnce() -> Vec<String>,
) -> FResult<&'a Module> {
    cell.get_or_init(|| Module::compile(ctx, source.what, source.text, &names()))
        .as_ref()
        .map_err(|e| FusedError::Tensor(super::derr(op, e)))
}

/// Whether the module in `cell` of the library's `source` is ready, or would load from an image
/// embedded in the binary for `ctx`'s device (no compiling, no disk).
pub(crate) fn loads_at_once(
    cell: &OnceLock<Result<Module, String>>,
    ctx: &Arc<CudaContext>,
    source: &LibrarySource,
) -> bool {
    match cell.get() {
        Some(m) => m.is_ok(),
        None => arch(ctx).is_ok_and(|a| find(EMBEDDED, source.text, &nvrtc_options(a)).is_some()),
    }
}

/// Launches `$func` on runtime `$rt`'s compute stream with config `$cfg` and the argument
/// variables (each passed by reference, as the kernel's parameters in order).
macro_rules! launch_fn {
    ($rt:expr, $op:expr, $func:expr, $cfg:expr; $($a:expr),* $(,)?) => {{
        $rt.bind($op)?;
        use cudarc::driver::PushKernelArg as _;
        let mut b = $rt.stream().launch_builder($func);
        $( b.arg(&$a); )*
        // SAFETY: the arguments match the kernel's parameters in order and type; every pointer
        // is a live device allocation covering what the kernel indexes (checked by the caller).
        $crate::launched($op, unsafe { b.launch($cfg) }).map_err($crate::raw::FusedError::Tensor)
    }};
}
pub(crate) use launch_fn;
