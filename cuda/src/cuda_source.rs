//! `CudaSource`: a CUDA source of a crate outside the library (its kernels named by a
//! `KernelIds` enum), made ready once per process through the library's NVRTC path.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaFunction, CudaModule};

use crate::error::derr;
use crate::nvrtc_module::load_source;
use crate::runtime::CudaRuntime;

/// The kernels of one CUDA source as a typed id: an enum naming every `extern "C"` entry
/// point the source defines, so launches look kernels up by value, never by a built string.
pub trait KernelIds: Copy + PartialEq + fmt::Debug + Send + Sync + 'static {
    /// Every kernel of the source.
    const ALL: &'static [Self];
    /// The kernel's entry point in the source.
    fn entry(self) -> &'static str;
}

/// The kernels of a loaded source, in `K::ALL`'s order.
struct Loaded {
    funcs: Vec<CudaFunction>,
    _module: Arc<CudaModule>,
}

// SAFETY: as for `Module`: driver handles the CUDA driver lets any thread use.
unsafe impl Sync for Loaded {}
// SAFETY: as above.
unsafe impl Send for Loaded {}

/// A CUDA source of a crate outside the library, made ready once per process through the
/// library's path (the on-disk kernel cache, else NVRTC, with the library's options for the
/// device's own architecture; build times recorded in `kernel_builds`), after the library's
/// device prelude (`bf16_t`/`f16_t` with `ld`/`st` through f32, warp reductions); its kernels
/// named by `K`.
pub struct CudaSource<K: KernelIds> {
    what: &'static str,
    text: &'static str,
    loaded: OnceLock<Result<Loaded, String>>,
    _kernels: PhantomData<K>,
}

impl<K: KernelIds> CudaSource<K> {
    /// The source `text` (named `what` in build records and errors).
    pub const fn new(what: &'static str, text: &'static str) -> Self {
        CudaSource {
            what,
            text,
            loaded: OnceLock::new(),
            _kernels: PhantomData,
        }
    }

    /// Kernel `k` on `rt`'s device, loading the source on first use (a failure is kept and
    /// reported again, naming `op`).
    pub fn function(
        &self,
        rt: &CudaRuntime,
        op: &'static str,
        k: K,
    ) -> oxiflow_tensor::Result<&CudaFunction> {
        let loaded = self.loaded.get_or_init(|| {
            let text = format!("{}{}", crate::library_sources::DEVICE_TYPES, self.text);
            let module = load_source(rt.context(), self.what, &text)?;
            let funcs = K::ALL
                .iter()
                .map(|id| {
                    module
                        .load_function(id.entry())
                        .map_err(|e| format!("kernel {}: {e}", id.entry()))
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(Loaded {
                funcs,
                _module: module,
            })
        });
        let loaded = loaded
            .as_ref()
            .map_err(|e| derr(op, format!("{}: {e}", self.what)))?;
        K::ALL
            .iter()
            .position(|&id| id == k)
            .and_then(|i| loaded.funcs.get(i))
            .ok_or_else(|| derr(op, format!("{k:?} is not listed in its KernelIds::ALL")))
    }
}
