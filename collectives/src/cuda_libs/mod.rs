//! Finding the CUDA libraries (driver, NCCL, cuBLAS, NVRTC, cuDNN) at run time, before cudarc touches them.
//!
//! cudarc's dynamic loader `dlopen`s fixed names (`libcuda.so`, `libcublas.so.13`, ...) and
//! *panics* when none loads. The CUDA 13 folder (`/usr/local/cuda-13.0/targets/x86_64-linux/lib`)
//! is not on the default loader path of the GPU machines, and NCCL may exist only as
//! `libnccl.so.2`, a name cudarc never tries. So OxiFlow probes first:
//!
//! * every library is looked for by file in a list of folders (the caller's extra folders first,
//!   then the usual CUDA locations), then by bare name through the system loader;
//! * the first file that loads is `dlopen`ed by full path with `RTLD_GLOBAL` and kept loaded for
//!   the life of the process. glibc matches a later `dlopen("libcublas.so.13")` (what cudarc
//!   asks for) against the SONAME of an already-loaded object, so cudarc then finds the library
//!   we loaded instead of searching the loader path and panicking;
//! * NCCL is not loaded through cudarc at all: [`crate::nccl`] binds its symbols itself from the
//!   probed path, so `libnccl.so.2`-only installs work.
//!
//! * cuDNN is often installed only inside a Python environment (`site-packages/nvidia/cudnn/lib`);
//!   [`ensure_cudnn`] also searches those folders ([`python_lib_dirs`]) and preloads cuDNN's sub-libraries
//!   from the folder where `libcudnn.so.9` was found.
//!
//! A missing library becomes [`CudaLibError`] naming the library and every place looked at.

mod places;
mod site;

pub use places::{python_lib_dirs, DEFAULT_DIRS, NVRTC_FILES};
pub use site::{ensure_cudnn, CudnnLibs};

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use thiserror::Error;

/// The libraries OxiFlow loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaLib {
    /// The CUDA driver (`libcuda.so.1`).
    Driver,
    /// NCCL (`libnccl.so`, `libnccl.so.2`).
    Nccl,
    /// cuBLASLt, a dependency of cuBLAS (`libcublasLt.so.13`).
    CublasLt,
    /// cuBLAS (`libcublas.so.13`).
    Cublas,
    /// NVRTC's builtins, loaded by NVRTC at compile time (`libnvrtc-builtins.so.13.0`).
    NvrtcBuiltins,
    /// NVRTC (`libnvrtc.so.13`).
    Nvrtc,
    /// cuDNN 9's graph sub-library (`libcudnn_graph.so.9`), loaded before [`CudaLib::Cudnn`].
    CudnnGraph,
    /// cuDNN 9 (`libcudnn.so.9`), the shim that loads the sub-libraries.
    Cudnn,
}

impl CudaLib {
    /// File names tried, best first.
    pub fn file_names(self) -> &'static [&'static str] {
        match self {
            CudaLib::Driver => &["libcuda.so.1", "libcuda.so"],
            CudaLib::Nccl => &["libnccl.so.2", "libnccl.so"],
            CudaLib::CublasLt => &["libcublasLt.so.13", "libcublasLt.so"],
            CudaLib::Cublas => &["libcublas.so.13", "libcublas.so"],
            CudaLib::NvrtcBuiltins => &[
                "libnvrtc-builtins.so.13.0",
                "libnvrtc-builtins.so.13",
                "libnvrtc-builtins.so",
            ],
            CudaLib::Nvrtc => NVRTC_FILES,
            CudaLib::CudnnGraph => &["libcudnn_graph.so.9", "libcudnn_graph.so"],
            CudaLib::Cudnn => &["libcudnn.so.9", "libcudnn.so"],
        }
    }
    /// A human-readable name.
    pub fn name(self) -> &'static str {
        match self {
            CudaLib::Driver => "CUDA driver",
            CudaLib::Nccl => "NCCL",
            CudaLib::CublasLt => "cuBLASLt",
            CudaLib::Cublas => "cuBLAS",
            CudaLib::NvrtcBuiltins => "NVRTC builtins",
            CudaLib::Nvrtc => "NVRTC",
            CudaLib::CudnnGraph => "cuDNN graph",
            CudaLib::Cudnn => "cuDNN",
        }
    }
}

impl fmt::Display for CudaLib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A library that could not be loaded, with every place looked at.
#[derive(Clone, Debug, Error)]
#[error("{lib} library not found (tried {names:?} in {dirs:?} and on the system loader path; last error: {last_error})")]
pub struct CudaLibError {
    pub lib: CudaLib,
    pub names: Vec<String>,
    pub dirs: Vec<PathBuf>,
    pub last_error: String,
}

/// Where to look, besides the built-in CUDA locations. Built by the caller (the launcher or
/// `collectives::env` reads variables; this module reads none).
#[derive(Clone, Debug, Default)]
pub struct LibSearch {
    /// Folders tried before the built-in ones.
    pub extra_dirs: Vec<PathBuf>,
    /// When false, only `extra_dirs` are searched (no built-in folders, no bare-name loading).
    pub only_extra: bool,
}

/// A library held loaded for the life of the process.
#[derive(Debug)]
pub struct LoadedLib {
    pub lib: CudaLib,
    /// The path it was loaded from (or the bare name, when found by the system loader).
    pub path: PathBuf,
    handle: usize,
}

impl LoadedLib {
    /// Looks up a symbol; `None` when absent.
    pub fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: handle is a live dlopen handle that is never closed.
        let p = unsafe { libc::dlsym(self.handle as *mut c_void, c.as_ptr()) };
        if p.is_null() {
            None
        } else {
            Some(p)
        }
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".to_string()
    } else {
        // SAFETY: non-null dlerror result is a valid C string.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

fn dlopen(path: &str) -> Result<usize, String> {
    let c = CString::new(path).map_err(|e| e.to_string())?;
    // SAFETY: plain dlopen of a library path; the handle is kept for the process lifetime.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        Err(dl_error())
    } else {
        Ok(h as usize)
    }
}

fn search_dirs(search: &LibSearch) -> Vec<PathBuf> {
    let mut dirs = search.extra_dirs.clone();
    if !search.only_extra {
        dirs.extend(DEFAULT_DIRS.iter().map(PathBuf::from));
    }
    dirs
}

/// Loads `lib` (the first candidate file that loads), without caching.
pub fn load_uncached(lib: CudaLib, search: &LibSearch) -> Result<LoadedLib, CudaLibError> {
    let dirs = search_dirs(search);
    let mut last_error = "no candidate file exists".to_string();
    for dir in &dirs {
        for name in lib.file_names() {
            let p = dir.join(name);
            if !p.exists() {
                continue;
            }
            match dlopen(&p.to_string_lossy()) {
                Ok(handle) => {
                    return Ok(LoadedLib {
                        lib,
                        path: p,
                        handle,
                    })
                }
                Err(e) => last_error = format!("{}: {e}", p.display()),
            }
        }
    }
    if !search.only_extra {
        for name in lib.file_names() {
            match dlopen(name) {
                Ok(handle) => {
                    return Ok(LoadedLib {
                        lib,
                        path: PathBuf::from(name),
                        handle,
                    })
                }
                Err(e) => last_error = e,
            }
        }
    }
    Err(CudaLibError {
        lib,
        names: lib.file_names().iter().map(|s| s.to_string()).collect(),
        dirs,
        last_error,
    })
}

type Cache = Mutex<Vec<(CudaLib, Result<&'static LoadedLib, CudaLibError>)>>;
static CACHE: OnceLock<Cache> = OnceLock::new();

/// Loads `lib` once per process (the first search wins; later calls return the same result).
pub fn load(lib: CudaLib, search: &LibSearch) -> Result<&'static LoadedLib, CudaLibError> {
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut g = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, r)) = g.iter().find(|(l, r)| *l == lib && r.is_ok()) {
        return r.clone();
    }
    let r = load_uncached(lib, search).map(|l| &*Box::leak(Box::new(l)));
    g.retain(|(l, _)| *l != lib);
    g.push((lib, r.clone()));
    r
}

/// Makes the CUDA driver loadable by cudarc; call before any `cudarc::driver` use.
pub fn ensure_driver(search: &LibSearch) -> Result<&'static LoadedLib, CudaLibError> {
    load(CudaLib::Driver, search)
}

/// Makes cuBLAS (and its cuBLASLt dependency) loadable by cudarc.
pub fn ensure_cublas(search: &LibSearch) -> Result<&'static LoadedLib, CudaLibError> {
    ensure_driver(search)?;
    load(CudaLib::CublasLt, search)?;
    load(CudaLib::Cublas, search)
}

/// Makes NVRTC (and its builtins, when present) loadable by cudarc.
pub fn ensure_nvrtc(search: &LibSearch) -> Result<&'static LoadedLib, CudaLibError> {
    let lib = load(CudaLib::Nvrtc, search)?;
    // The builtins are found by NVRTC next to itself on most installs; preloading them by
    // path covers installs where they are not.
    let _ = load(CudaLib::NvrtcBuiltins, search);
    Ok(lib)
}

/// What [`probe`] found: one line per library, for logs and `skipped:` messages.
#[derive(Debug)]
pub struct ProbeReport {
    pub found: Vec<(CudaLib, PathBuf)>,
    pub missing: Vec<CudaLibError>,
    /// Number of CUDA devices (0 when the driver is missing or reports an error).
    pub devices: usize,
    /// Why `devices` is 0, when it is.
    pub device_error: Option<String>,
}

impl ProbeReport {
    /// `Ok(device count)` when the driver and NCCL load and at least one GPU is visible.
    pub fn nccl_ready(&self) -> Result<usize, String> {
        if let Some(e) = self
            .missing
            .iter()
            .find(|e| matches!(e.lib, CudaLib::Driver | CudaLib::Nccl))
        {
            return Err(e.to_string());
        }
        if self.devices == 0 {
            return Err(self
                .device_error
                .clone()
                .unwrap_or_else(|| "the driver reports 0 CUDA devices".into()));
        }
        Ok(self.devices)
    }
}

/// Tries every library and counts devices. Never panics.
pub fn probe(search: &LibSearch) -> ProbeReport {
    let mut found = Vec::new();
    let mut missing = Vec::new();
    for lib in [
        CudaLib::Driver,
        CudaLib::Nccl,
        CudaLib::CublasLt,
        CudaLib::Cublas,
        CudaLib::Nvrtc,
    ] {
        match load(lib, search) {
            Ok(l) => found.push((lib, l.path.clone())),
            Err(e) => missing.push(e),
        }
    }
    let (devices, device_error) = match device_count(search) {
        Ok(n) => (n, None),
        Err(e) => (0, Some(e)),
    };
    ProbeReport {
        found,
        missing,
        devices,
        device_error,
    }
}

/// Number of CUDA devices, through the driver found by [`ensure_driver`].
pub fn device_count(search: &LibSearch) -> Result<usize, String> {
    let drv = ensure_driver(search).map_err(|e| e.to_string())?;
    // Call cuInit/cuDeviceGetCount through our own handle: no cudarc panic paths involved.
    let init = drv.symbol("cuInit").ok_or("libcuda has no cuInit")?;
    let count = drv
        .symbol("cuDeviceGetCount")
        .ok_or("libcuda has no cuDeviceGetCount")?;
    // SAFETY: the symbols have the documented driver API signatures.
    unsafe {
        let init: extern "C" fn(u32) -> i32 = std::mem::transmute(init);
        let count: extern "C" fn(*mut i32) -> i32 = std::mem::transmute(count);
        let r = init(0);
        if r != 0 {
            return Err(format!(
                "cuInit failed with CUresult {r} (no usable GPU or driver)"
            ));
        }
        let mut n = 0i32;
        let r = count(&mut n);
        if r != 0 {
            return Err(format!("cuDeviceGetCount failed with CUresult {r}"));
        }
        Ok(n.max(0) as usize)
    }
}

/// True when `path` names an existing file (for callers building `LibSearch` lists).
pub fn dir_has(dir: &Path, lib: CudaLib) -> bool {
    lib.file_names().iter().any(|n| dir.join(n).exists())
}

/// A new folder `oxiflow-{name}-{pid}` under the temporary directory and the search of it alone.
#[cfg(test)]
fn only_folder(name: &str) -> (std::path::PathBuf, LibSearch) {
    let dir = std::env::temp_dir().join(format!("oxiflow-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let search = LibSearch {
        extra_dirs: vec![dir.clone()],
        only_extra: true,
    };
    (dir, search)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_a_typed_error_naming_what_and_where() {
        let (dir, search) = only_folder("nolibs");
        let e = load_uncached(CudaLib::Nccl, &search).unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.lib, CudaLib::Nccl);
        assert!(
            msg.contains("NCCL") && msg.contains("libnccl.so.2"),
            "{msg}"
        );
        assert!(msg.contains(&dir.display().to_string()), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_library_is_reported_with_its_path() {
        let (dir, search) = only_folder("badlib");
        std::fs::write(dir.join("libnccl.so.2"), b"not an ELF file").unwrap();
        let e = load_uncached(CudaLib::Nccl, &search).unwrap_err();
        assert!(e.last_error.contains("libnccl.so.2"), "{}", e.last_error);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
