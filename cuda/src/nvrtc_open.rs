//! NVRTC opened by path for the build script (`cuda/build.rs`, which cannot use
//! `oxiflow_collectives::cuda_libs`): `OXIFLOW_NVRTC_LIB` when given, else the places the runtime
//! searches (passed in from `cuda_libs/places.rs`), else the system loader. Plain `std` only, a
//! module of the build script and of the crate's tests.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use super::nvrtc_compile::Nvrtc;

/// NVRTC opened by this process, and the file it came from.
pub(crate) struct OpenedNvrtc {
    pub api: Nvrtc,
    pub path: PathBuf,
}

/// `RTLD_NOW | RTLD_GLOBAL` (Linux): resolved at once, and visible to the libraries NVRTC
/// opens itself (its builtins), which glibc then matches by their SONAME.
const RTLD_NOW_GLOBAL: c_int = 0x2 | 0x100;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}

/// `dlopen`s `path` for the life of the process (the handle is never closed), or the loader's
/// message.
fn open_library(path: &str) -> Result<*mut c_void, String> {
    let c = CString::new(path).map_err(|_| format!("{path}: a NUL byte in the path"))?;
    // SAFETY: a plain dlopen of a NUL-terminated path.
    let handle = unsafe { dlopen(c.as_ptr(), RTLD_NOW_GLOBAL) };
    if !handle.is_null() {
        return Ok(handle);
    }
    // SAFETY: dlerror returns a thread-local NUL-terminated string or null.
    let e = unsafe { dlerror() };
    Err(if e.is_null() {
        format!("{path}: dlopen failed")
    } else {
        // SAFETY: non-null dlerror result is a NUL-terminated string.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    })
}

/// NVRTC's builtins library, opened from NVRTC's own folder when there (NVRTC loads it at
/// compile time by name; an already opened copy of that name is what it then gets).
const BUILTINS: &[&str] = &["libnvrtc-builtins.so.13.0", "libnvrtc-builtins.so.13"];

/// Opens the NVRTC at `path` (a file, or a folder holding one of `files`).
fn open_at(path: &Path, files: &[&str]) -> Result<OpenedNvrtc, String> {
    let file = if path.is_dir() {
        files
            .iter()
            .map(|f| path.join(f))
            .find(|p| p.exists())
            .ok_or_else(|| format!("{} holds none of {files:?}", path.display()))?
    } else {
        path.to_path_buf()
    };
    let handle = open_library(&file.to_string_lossy())?;
    if let Some(dir) = file.parent() {
        if let Some(b) = BUILTINS.iter().map(|b| dir.join(b)).find(|b| b.exists()) {
            // Without it NVRTC searches the loader path itself; a compile then says why.
            let _ = open_library(&b.to_string_lossy());
        }
    }
    let api = Nvrtc::from_symbols(|name| {
        let c = CString::new(name).ok()?;
        // SAFETY: `handle` is a live dlopen handle that is never closed.
        let p = unsafe { dlsym(handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    })
    .map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(OpenedNvrtc { api, path: file })
}

/// Opens NVRTC: `explicit` (a file or a folder; nothing else is tried when given), else the
/// first of `files` that opens in `dirs`, else `files` by bare name through the system loader.
/// The error names every place tried.
pub(crate) fn open(
    explicit: Option<&Path>,
    dirs: &[PathBuf],
    files: &[&str],
) -> Result<OpenedNvrtc, String> {
    if let Some(p) = explicit {
        return open_at(p, files).map_err(|e| format!("NVRTC at {}: {e}", p.display()));
    }
    let mut tried = Vec::new();
    for dir in dirs {
        for f in files {
            let p = dir.join(f);
            if p.exists() {
                match open_at(&p, files) {
                    Ok(o) => return Ok(o),
                    Err(e) => tried.push(e),
                }
            }
        }
    }
    for f in files {
        match open_at(Path::new(f), files) {
            Ok(o) => return Ok(o),
            Err(e) => tried.push(e),
        }
    }
    Err(format!(
        "NVRTC ({files:?}) not found in {dirs:?} nor on the system loader path: {}",
        tried.join("; ")
    ))
}

/// The folders NVRTC is looked for in, in order: `$CUDA_HOME` and `$CUDA_PATH` (their `lib64`
/// and `targets/x86_64-linux/lib`), `$LD_LIBRARY_PATH`'s folders, `default_dirs` (the runtime's
/// CUDA folders), then `python_dirs` (NVIDIA's Python wheels).
pub(crate) fn search_dirs(default_dirs: &[&str], python_dirs: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            let home = PathBuf::from(home);
            dirs.push(home.join("lib64"));
            dirs.push(home.join("targets/x86_64-linux/lib"));
        }
    }
    if let Some(ld) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&ld).filter(|p| !p.as_os_str().is_empty()));
    }
    dirs.extend(default_dirs.iter().map(PathBuf::from));
    dirs.extend(python_dirs);
    let mut unique: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if !unique.contains(&d) {
            unique.push(d);
        }
    }
    unique
}

#[cfg(test)]
mod tests {
    use super::super::library_sources::{nvrtc_options, COPY_MANY};
    use super::*;
    use oxiflow_collectives::cuda_libs::{python_lib_dirs, DEFAULT_DIRS, NVRTC_FILES};

    /// NVRTC as the build script finds it, or None (the test is then skipped).
    fn nvrtc() -> Option<OpenedNvrtc> {
        let explicit = std::env::var_os("OXIFLOW_NVRTC_LIB")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        let dirs = search_dirs(DEFAULT_DIRS, python_lib_dirs());
        match open(explicit.as_deref(), &dirs, NVRTC_FILES) {
            Ok(n) => Some(n),
            Err(e) => {
                println!("skipped: no NVRTC on this machine (set OXIFLOW_NVRTC_LIB): {e}");
                None
            }
        }
    }

    #[test]
    fn a_library_source_compiles_to_a_cubin_as_the_build_compiles_it() {
        let Some(nvrtc) = nvrtc() else { return };
        let image = nvrtc
            .api
            .compile(COPY_MANY.text, &nvrtc_options("sm_90"))
            .unwrap_or_else(|e| panic!("{}: {e}", nvrtc.path.display()));
        assert!(
            image.starts_with(b"\x7fELF"),
            "{:?}",
            &image[..image.len().min(8)]
        );
        assert!(nvrtc.api.version().0 >= 12, "{:?}", nvrtc.api.version());
    }

    #[test]
    fn a_failed_compile_returns_nvrtcs_log() {
        let Some(nvrtc) = nvrtc() else { return };
        let e = nvrtc
            .api
            .compile(
                "extern \"C\" __global__ void k() { undeclared_name(); }",
                &nvrtc_options("sm_90"),
            )
            .unwrap_err();
        assert!(e.contains("undeclared_name"), "{e}");
        let e = nvrtc
            .api
            .compile("", &["--gpu-architecture=sm_1".to_string()])
            .unwrap_err();
        assert!(e.starts_with("NVRTC"), "{e}");
    }

    #[test]
    fn a_named_nvrtc_that_is_missing_is_an_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("oxiflow-no-nvrtc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = open(Some(&dir), &[], NVRTC_FILES)
            .err()
            .expect("no NVRTC there");
        assert!(e.contains(&dir.display().to_string()), "{e}");
        assert!(e.contains("libnvrtc.so.13"), "{e}");
        let file = dir.join("libnvrtc.so.13");
        std::fs::write(&file, b"not a library").unwrap();
        let e = open(Some(&file), &[], NVRTC_FILES)
            .err()
            .expect("not a library");
        assert!(e.contains("libnvrtc.so.13"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
