//! The on-disk kernel cache: an NVRTC source compiled straight to the device's machine code
//! (a CUBIN for `sm_XY`, so the driver loads it without compiling PTX), stored under the
//! SHA-256 of the source, the options, the architecture and the NVRTC version. A later process
//! (or a second runtime) loads the file instead of compiling. The directory is
//! `$OXIFLOW_KERNEL_CACHE`, else `$XDG_CACHE_HOME/oxiflow/kernels`, else
//! `$HOME/.cache/oxiflow/kernels`; `OXIFLOW_KERNEL_CACHE=off` turns the cache off. A file that
//! cannot be read or written only costs a compile: the cache never decides what runs.

use std::path::PathBuf;
use std::sync::OnceLock;

use oxiflow_collectives::cuda_libs::{self, LibSearch};
use sha2::{Digest, Sha256};

use super::build_times::KernelOrigin;
use super::nvrtc_compile::Nvrtc;

/// The cache directory (None: off, or no home to put it in; see
/// `oxiflow_collectives::env::kernel_cache_dir`).
fn dir() -> Option<PathBuf> {
    oxiflow_collectives::env::kernel_cache_dir()
}

/// This process's NVRTC, found by `cuda_libs` (once; a failure is kept and reported again).
fn nvrtc() -> Result<&'static Nvrtc, String> {
    static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            let lib = cuda_libs::ensure_nvrtc(&LibSearch::default()).map_err(|e| e.to_string())?;
            Nvrtc::from_symbols(|name| lib.symbol(name))
                .map_err(|e| format!("{}: {e}", lib.path.display()))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The cache key of `source` under `options` (which name the architecture) with `nvrtc`.
fn key(nvrtc: &Nvrtc, source: &str, options: &[String]) -> String {
    key_for(nvrtc.version(), source, options)
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
pub(crate) fn cubin(source: &str, options: &[String]) -> Result<(Vec<u8>, KernelOrigin), String> {
    let nvrtc = nvrtc()?;
    if let Some(d) = dir() {
        // An ELF image, whole (a torn write never gets the final name).
        if let Ok(bytes) = std::fs::read(d.join(format!("{}.cubin", key(nvrtc, source, options)))) {
            if bytes.starts_with(b"\x7fELF") {
                return Ok((bytes, KernelOrigin::DiskCache));
            }
        }
    }
    Ok((recompile(source, options)?, KernelOrigin::Compiled))
}

/// `source` compiled by NVRTC whatever the cache holds, and stored there (e.g. after a cached
/// image failed to load).
pub(crate) fn recompile(source: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let nvrtc = nvrtc()?;
    let image = nvrtc.compile(source, options)?;
    if let Some(d) = dir() {
        store(
            &d.join(format!("{}.cubin", key(nvrtc, source, options))),
            &image,
        );
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
