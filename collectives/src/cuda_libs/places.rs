//! Where CUDA libraries are looked for: the usual CUDA folders, the folders of NVIDIA's Python
//! wheels, NVRTC's file names. Plain `std` only, so a build script can take this file as a
//! module of its own (`cuda/build.rs` finds NVRTC with it).

use std::path::PathBuf;

/// Folders where CUDA 13 installs usually put their libraries (also the GPU machines' layout).
pub const DEFAULT_DIRS: &[&str] = &[
    "/usr/local/nvidia/lib64",
    "/usr/local/cuda-13.0/targets/x86_64-linux/lib",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/local/cuda/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/usr/local/lib",
];

/// NVRTC's file names, best first.
pub const NVRTC_FILES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so"];

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
}
