//! The on-disk kernel cache: an NVRTC source compiled straight to the device's machine code
//! (a CUBIN for `sm_XY`, so the driver loads it without compiling PTX), stored under the
//! SHA-256 of the source, the options, the architecture and the NVRTC version. A later process
//! (or a second runtime) loads the file instead of compiling. The directory is
//! `$OXIFLOW_KERNEL_CACHE`, else `$XDG_CACHE_HOME/oxiflow/kernels`, else
//! `$HOME/.cache/oxiflow/kernels`; `OXIFLOW_KERNEL_CACHE=off` turns the cache off. A file that
//! cannot be read or written only costs a compile: the cache never decides what runs.

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result, sys};
use sha2::{Digest, Sha256};

/// Where compiled kernels came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    Compiled,
    Cache,
}

/// The cache directory (None: off, or no home to put it in).
fn dir() -> Option<PathBuf> {
    match std::env::var_os("OXIFLOW_KERNEL_CACHE") {
        Some(v) if v == "off" || v == "0" || v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|c| c.join("oxiflow").join("kernels")),
    }
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for one int each.
    let _ = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// The cache key of `source` under `options` (which name the architecture).
fn key(source: &str, options: &[String]) -> String {
    let mut h = Sha256::new();
    h.update(b"oxiflow kernel cache v1\0");
    let (major, minor) = nvrtc_version();
    h.update(format!("nvrtc {major}.{minor}\0").as_bytes());
    for o in options {
        h.update(o.as_bytes());
        h.update(b"\0");
    }
    h.update(source.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A CUBIN of `source` compiled with `options` (which must include `--gpu-architecture=sm_XY`):
/// from the cache when present, else compiled by NVRTC and stored.
pub(crate) fn cubin(source: &str, options: &[String]) -> Result<(Vec<u8>, Origin), String> {
    let path = dir().map(|d| d.join(format!("{}.cubin", key(source, options))));
    if let Some(p) = &path {
        // An ELF image, whole (a torn write never gets the final name).
        if let Ok(bytes) = std::fs::read(p) {
            if bytes.starts_with(b"\x7fELF") {
                return Ok((bytes, Origin::Cache));
            }
        }
    }
    let image = compile(source, options)?;
    if let Some(p) = &path {
        store(p, &image);
    }
    Ok((image, Origin::Compiled))
}

/// Writes `image` to `path` through a temporary name, so readers see all of it or nothing.
fn store(path: &PathBuf, image: &[u8]) {
    let Some(parent) = path.parent() else { return };
    if std::fs::create_dir_all(parent).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, image).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// NVRTC's CUBIN of `source` under `options`, or its log.
fn compile(source: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let src = CString::new(source).map_err(|_| "NVRTC: the source holds a NUL byte".to_string())?;
    let prog = result::create_program(&src, None).map_err(|e| format!("NVRTC: {e}"))?;
    // SAFETY: `prog` was created above and is destroyed once, below, after the last use.
    let out = unsafe { compiled_image(prog, options) };
    // SAFETY: as above.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// # Safety
/// `prog` must be a live program from `create_program`.
unsafe fn compiled_image(prog: sys::nvrtcProgram, options: &[String]) -> Result<Vec<u8>, String> {
    // SAFETY: `prog` is live (the caller's contract).
    if let Err(e) = unsafe { result::compile_program(prog, options) } {
        // SAFETY: as above; the log is a NUL-terminated string NVRTC wrote.
        let log = unsafe { result::get_program_log(prog) }
            .map(|l| {
                let bytes: Vec<u8> = l
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        return Err(format!("NVRTC: {e}: {log}"));
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled; `size` is valid for one usize.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| format!("NVRTC CUBIN size: {e}"))?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds the `size` bytes NVRTC reported for this program's CUBIN.
    unsafe { sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| format!("NVRTC CUBIN: {e}"))?;
    Ok(image)
}
