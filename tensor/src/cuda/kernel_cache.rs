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

/// The cache key of `source` under `options` (which name the architecture) with this
/// process's NVRTC.
fn key(source: &str, options: &[String]) -> String {
    key_for(nvrtc_version(), source, options)
}

/// The cache key of `source` under `options` for NVRTC `(major, minor)`.
fn key_for((major, minor): (i32, i32), source: &str, options: &[String]) -> String {
    let mut h = Sha256::new();
    h.update(b"oxiflow kernel cache v1\0");
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
    if let Some(d) = dir() {
        // An ELF image, whole (a torn write never gets the final name).
        if let Ok(bytes) = std::fs::read(d.join(format!("{}.cubin", key(source, options)))) {
            if bytes.starts_with(b"\x7fELF") {
                return Ok((bytes, Origin::Cache));
            }
        }
    }
    Ok((recompile(source, options)?, Origin::Compiled))
}

/// `source` compiled by NVRTC whatever the cache holds, and stored there (e.g. after a cached
/// image failed to load).
pub(crate) fn recompile(source: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let image = compile(source, options)?;
    if let Some(d) = dir() {
        store(&d.join(format!("{}.cubin", key(source, options))), &image);
    }
    Ok(image)
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

/// An NVRTC program, destroyed when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_program` and is destroyed only here, once.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// NVRTC's CUBIN of `source` under `options`, or its log.
fn compile(source: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let src = CString::new(source).map_err(|_| "NVRTC: the source holds a NUL byte".to_string())?;
    let prog = Program(result::create_program(&src, None).map_err(|e| format!("NVRTC: {e}"))?);
    // SAFETY: `prog` is a live program (destroyed only when it drops, after this function).
    if let Err(e) = unsafe { result::compile_program(prog.0, options) } {
        // SAFETY: as above; the log is a NUL-terminated string NVRTC wrote.
        let log = unsafe { result::get_program_log(prog.0) }
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
    // SAFETY: `prog` is live and compiled; `size` is valid for one usize.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| format!("NVRTC CUBIN size: {e}"))?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds the `size` bytes NVRTC reported for this program's CUBIN.
    unsafe { sys::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| format!("NVRTC CUBIN: {e}"))?;
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_names_source_options_and_nvrtc() {
        let opts = |a: &str| vec![format!("--gpu-architecture={a}"), "--fmad=true".to_string()];
        let k = key_for((13, 0), "src", &opts("sm_90"));
        assert_eq!(k.len(), 64);
        assert_eq!(k, key_for((13, 0), "src", &opts("sm_90")));
        assert_ne!(k, key_for((13, 0), "src2", &opts("sm_90")));
        assert_ne!(k, key_for((13, 0), "src", &opts("sm_80")));
        assert_ne!(k, key_for((12, 8), "src", &opts("sm_90")));
        // Options are separated, so moving a character between them changes the key.
        let split = |a: &str, b: &str| key_for((13, 0), "s", &[a.to_string(), b.to_string()]);
        assert_ne!(split("ab", "c"), split("a", "bc"));
    }

    #[test]
    fn a_stored_image_reads_back_whole_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("oxiflow-kernel-cache-{}", std::process::id()));
        let path = dir.join("k.cubin");
        store(&path, b"\x7fELF image");
        assert_eq!(std::fs::read(&path).unwrap(), b"\x7fELF image");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
