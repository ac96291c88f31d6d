//! cuDNN at run time: loading `libcudnn.so.9` (also from the folders where Python environments
//! keep NVIDIA's libraries, `site-packages/nvidia/cudnn/lib`, `.../nvidia/cu13/lib`) with its
//! sub-libraries (`libcudnn_graph.so.9`, the engine libraries, ...) from the folder it was found
//! in, so that the shim's own `dlopen`s of its sub-libraries find the loaded copies.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::places::python_lib_dirs;
use super::{
    dlopen, ensure_driver, ensure_nvrtc, load, CudaLib, CudaLibError, LibSearch, LoadedLib,
};

/// cuDNN 9's sub-libraries, loaded in this order (the graph library first: the others need it).
const CUDNN_SUBLIBS: &[&str] = &[
    "libcudnn_graph.so.9",
    "libcudnn_engines_precompiled.so.9",
    "libcudnn_engines_runtime_compiled.so.9",
    "libcudnn_heuristic.so.9",
    "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9",
    "libcudnn_adv.so.9",
];

/// cuDNN as loaded: the shim, and what became of each sub-library found beside it.
#[derive(Debug)]
pub struct CudnnLibs {
    pub main: &'static LoadedLib,
    /// Sub-libraries loaded from the shim's folder.
    pub loaded: Vec<PathBuf>,
    /// Sub-libraries present but not loadable, with the loader's message.
    pub failed: Vec<(PathBuf, String)>,
}

static CUDNN: Mutex<Option<&'static CudnnLibs>> = Mutex::new(None);

/// Loads cuDNN once per process: the caller's folders, the CUDA folders and the Python wheels'
/// folders are searched; the CUDA driver and NVRTC (cuDNN compiles engines at run time) are
/// loaded first. A missing cuDNN is a typed error, never a panic.
pub fn ensure_cudnn(search: &LibSearch) -> Result<&'static CudnnLibs, CudaLibError> {
    let mut g = CUDNN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(libs) = *g {
        return Ok(libs);
    }
    ensure_driver(search)?;
    // Engines that compile at run time need NVRTC; without it cuDNN refuses those plans.
    let _ = ensure_nvrtc(search);
    let mut wide = search.clone();
    if !search.only_extra {
        wide.extra_dirs.extend(python_lib_dirs());
    }
    // The graph library first (the shim and the engines link against it).
    let graph = load(CudaLib::CudnnGraph, &wide).ok();
    let main = load(CudaLib::Cudnn, &wide)?;
    let dir = main
        .path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .or_else(|| graph.and_then(|g| g.path.parent()))
        .map(Path::to_path_buf);
    let (mut loaded, mut failed) = (Vec::new(), Vec::new());
    if let Some(dir) = dir {
        for name in CUDNN_SUBLIBS {
            let p = dir.join(name);
            if !p.exists() {
                continue;
            }
            match dlopen(&p.to_string_lossy()) {
                Ok(_) => loaded.push(p),
                Err(e) => failed.push((p, e)),
            }
        }
    }
    let libs: &'static CudnnLibs = Box::leak(Box::new(CudnnLibs {
        main,
        loaded,
        failed,
    }));
    *g = Some(libs);
    Ok(libs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_cudnn_is_a_typed_error() {
        let (dir, search) = super::super::only_folder("nocudnn");
        let e = super::super::load_uncached(CudaLib::Cudnn, &search).unwrap_err();
        assert_eq!(e.lib, CudaLib::Cudnn);
        assert!(e.to_string().contains("libcudnn.so.9"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
