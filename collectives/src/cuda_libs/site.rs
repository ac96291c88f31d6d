//! cuDNN at run time: the folders where Python environments keep NVIDIA's libraries
//! (`site-packages/nvidia/cudnn/lib`, `.../nvidia/cu13/lib`), and loading `libcudnn.so.9` with its
//! sub-libraries (`libcudnn_graph.so.9`, the engine libraries, ...) from the folder it was found
//! in, so that the shim's own `dlopen`s of its sub-libraries find the loaded copies.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::{
    dlopen, ensure_driver, ensure_nvrtc, load, CudaLib, CudaLibError, LibSearch, LoadedLib,
};

/// Python site folders, as glob patterns (`*` matches within one path component).
const SITE_PATTERNS: &[&str] = &[
    "/usr/local/lib/python3*/dist-packages",
    "/usr/local/lib/python3*/site-packages",
    "/usr/lib/python3*/dist-packages",
    "/usr/lib/python3*/site-packages",
    "/opt/*/lib/python3*/site-packages",
    "/opt/*/*/lib/python3*/site-packages",
    "/opt/*/envs/*/lib/python3*/site-packages",
    "/root/*/lib/python3*/site-packages",
    "/root/.*/lib/python3*/site-packages",
    "/root/.local/lib/python3*/site-packages",
    "/home/*/.local/lib/python3*/site-packages",
    "/venv/lib/python3*/site-packages",
];

/// Library folders inside a site folder (NVIDIA's wheels: per library, or one per CUDA major).
const WHEEL_LIB_DIRS: &[&str] = &[
    "nvidia/cudnn/lib",
    "nvidia/cu13/lib",
    "nvidia/cublas/lib",
    "nvidia/cuda_nvrtc/lib",
];

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

/// Whether `name` matches `pattern`, where `*` matches any run of characters.
fn wildcard(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// Existing folders matching `pattern` (absolute, `*` within components).
fn glob_dirs(pattern: &str) -> Vec<PathBuf> {
    let mut found = vec![PathBuf::from("/")];
    for comp in pattern.split('/').filter(|c| !c.is_empty()) {
        let mut next = Vec::new();
        for base in &found {
            if !comp.contains('*') {
                let p = base.join(comp);
                if p.is_dir() {
                    next.push(p);
                }
                continue;
            }
            let Ok(entries) = std::fs::read_dir(base) else {
                continue;
            };
            let mut names: Vec<PathBuf> = entries
                .flatten()
                .filter(|e| wildcard(comp, &e.file_name().to_string_lossy()))
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect();
            names.sort();
            next.extend(names);
        }
        found = next;
    }
    found
}

/// Library folders of NVIDIA's Python wheels on this machine (existing ones, in search order).
pub fn python_lib_dirs() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for pattern in SITE_PATTERNS {
        for site in glob_dirs(pattern) {
            for sub in WHEEL_LIB_DIRS {
                let d = site.join(sub);
                if d.is_dir() && !out.contains(&d) {
                    out.push(d);
                }
            }
        }
    }
    out
}

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
    fn wildcards_match_within_a_component() {
        assert!(wildcard("python3*", "python3.12"));
        assert!(wildcard("python3*", "python3"));
        assert!(!wildcard("python3*", "python2.7"));
        assert!(wildcard(".*", ".venv"));
        assert!(!wildcard(".*", "venv"));
        assert!(wildcard("a*b*c", "axxbyyc"));
        assert!(!wildcard("a*b*c", "axxc"));
        assert!(wildcard("exact", "exact"));
    }

    #[test]
    fn globbing_finds_existing_folders_only() {
        let root = std::env::temp_dir().join(format!("oxiflow-glob-{}", std::process::id()));
        for d in [
            "lib/python3.11/site-packages",
            "lib/python3.12/site-packages",
            "lib/other",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let pattern = format!("{}/lib/python3*/site-packages", root.display());
        let found = glob_dirs(&pattern);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].ends_with("python3.11/site-packages"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_missing_cudnn_is_a_typed_error() {
        let dir = std::env::temp_dir().join(format!("oxiflow-nocudnn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let search = LibSearch {
            extra_dirs: vec![dir.clone()],
            only_extra: true,
        };
        let e = super::super::load_uncached(CudaLib::Cudnn, &search).unwrap_err();
        assert_eq!(e.lib, CudaLib::Cudnn);
        assert!(e.to_string().contains("libcudnn.so.9"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
