//! Compiles the library's own NVRTC sources ahead of time when `OXIFLOW_PREBUILD_ARCHS` names
//! architectures (`sm_90`, `sm_80,sm_90`): NVRTC (`OXIFLOW_NVRTC_LIB`, a file or folder, else
//! the places the runtime searches) compiles every source of `src/library_sources.rs` for
//! each architecture with the runtime's options, on several threads, and the CUBINs are embedded
//! through a generated table (`$OUT_DIR/embedded_kernels.rs`, read by
//! `src/embedded_kernels.rs`). A build asked for prebuilt kernels fails, naming the source,
//! the architecture and NVRTC's log, when NVRTC is missing or a compile fails. Unset: the table
//! is empty and nothing is compiled.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

#[allow(dead_code)]
#[path = "src/library_sources.rs"]
mod library_sources;
#[allow(dead_code)]
#[path = "src/nvrtc_compile.rs"]
mod nvrtc_compile;
#[path = "src/nvrtc_open.rs"]
mod nvrtc_open;
#[allow(dead_code)]
#[path = "../collectives/src/cuda_libs/places.rs"]
mod places;

use library_sources::{
    image_key, nvrtc_options, pack_image, prebuild_archs, unpack_image, LibrarySource, ALL,
};

/// One source's CUBIN for one architecture and its packed form, or NVRTC's error and log.
type Compiled = Result<(Vec<u8>, Vec<u8>), String>;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=OXIFLOW_PREBUILD_ARCHS");
    println!("cargo:rerun-if-env-changed=OXIFLOW_NVRTC_LIB");
    if let Err(e) = run() {
        eprintln!("error: prebuilt kernels (OXIFLOW_PREBUILD_ARCHS): {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("cargo set no OUT_DIR")?);
    let table = out.join("embedded_kernels.rs");
    let value = match std::env::var("OXIFLOW_PREBUILD_ARCHS") {
        Ok(v) => v,
        Err(std::env::VarError::NotPresent) => String::new(),
        Err(e) => return Err(format!("reading the variable: {e}")),
    };
    let archs = prebuild_archs(&value)?;
    if archs.is_empty() {
        return write(&table, "&[]\n");
    }
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    let explicit = std::env::var_os("OXIFLOW_NVRTC_LIB")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let dirs = nvrtc_open::search_dirs(places::DEFAULT_DIRS, places::python_lib_dirs());
    let nvrtc = nvrtc_open::open(explicit.as_deref(), &dirs, places::NVRTC_FILES)?;
    println!("cargo:rerun-if-changed={}", nvrtc.path.display());

    let jobs: Vec<(&LibrarySource, &str)> = archs
        .iter()
        .flat_map(|a| ALL.iter().map(move |s| (*s, a.as_str())))
        .collect();
    let threads = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
        .clamp(1, jobs.len());
    let next = AtomicUsize::new(0);
    let images: Mutex<Vec<Option<Compiled>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(source, arch)) = jobs.get(i) else {
                    break;
                };
                let r = nvrtc
                    .api
                    .compile(source.text, &nvrtc_options(arch))
                    .map(|image| {
                        let packed = pack_image(&image);
                        (image, packed)
                    });
                images.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
            });
        }
    });
    let images = images.into_inner().unwrap_or_else(|p| p.into_inner());

    let dir = out.join("kernels");
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut rows = String::from("&[\n");
    for (i, ((source, arch), image)) in jobs.iter().zip(images).enumerate() {
        let what = source.what;
        let (image, packed) = image
            .ok_or_else(|| format!("{what} for {arch}: no compile ran"))?
            .map_err(|e| {
                format!(
                    "compiling {what} for {arch} with {}: {e}",
                    nvrtc.path.display()
                )
            })?;
        if !image.starts_with(b"\x7fELF") {
            return Err(format!("{what} for {arch}: NVRTC's CUBIN is no ELF image"));
        }
        unpack_image(&packed, image.len()).map_err(|e| format!("{what} for {arch}: {e}"))?;
        let file = dir.join(format!("{i}_{arch}.cubin.deflate"));
        std::fs::write(&file, &packed).map_err(|e| format!("writing {}: {e}", file.display()))?;
        let key = image_key(source.text, &nvrtc_options(arch));
        rows.push_str(&format!(
            "    EmbeddedImage {{ arch: {arch:?}, key: {key:#x}, len: {}, packed: include_bytes!({:?}) }},\n",
            image.len(),
            file.display().to_string()
        ));
    }
    rows.push_str("]\n");
    write(&table, &rows)
}

/// Writes `text` to `path`.
fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}
