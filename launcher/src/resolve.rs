//! PROGRAM lookup: a path, a binary or example built beside oflaunch, or a name on PATH.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::error::LaunchError;

/// Finds the program to run. `exe_dir` is oflaunch's own folder (its target directory);
/// `path_var` is the value of PATH.
///
/// Order: a name containing '/' is a path; else `exe_dir/NAME`, `exe_dir/examples/NAME`, then
/// each PATH entry. The error lists every place looked at.
pub fn resolve_program(
    name: &str,
    exe_dir: Option<&Path>,
    path_var: Option<OsString>,
) -> Result<PathBuf, LaunchError> {
    if name.is_empty() {
        return Err(LaunchError::Usage("PROGRAM is empty".into()));
    }
    if name.contains('/') {
        let p = PathBuf::from(name);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(LaunchError::ProgramNotFound {
                program: name.into(),
                looked: format!("{} (not an executable file)", p.display()),
            })
        };
    }
    let mut candidates = Vec::new();
    if let Some(dir) = exe_dir {
        candidates.push(dir.join(name));
        candidates.push(dir.join("examples").join(name));
    }
    if let Some(path_var) = path_var {
        for dir in std::env::split_paths(&path_var) {
            if !dir.as_os_str().is_empty() {
                candidates.push(dir.join(name));
            }
        }
    }
    if let Some(found) = candidates.iter().find(|c| is_executable(c)) {
        return Ok(found.clone());
    }
    let looked = candidates
        .iter()
        .map(|c| c.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Err(LaunchError::ProgramNotFound {
        program: name.into(),
        looked: if looked.is_empty() {
            "nowhere (no oflaunch folder, PATH unset)".into()
        } else {
            looked
        },
    })
}

fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make_exe(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn order_and_error() {
        let root = std::env::temp_dir().join(format!("oflaunch_resolve_{}", std::process::id()));
        let target = root.join("target");
        let bin = root.join("bin");
        make_exe(&target.join("examples").join("train"));
        make_exe(&bin.join("train"));
        make_exe(&bin.join("other"));
        let path = std::env::join_paths([&bin]).unwrap();
        let got = resolve_program("train", Some(&target), Some(path.clone())).unwrap();
        assert_eq!(got, target.join("examples").join("train"));
        make_exe(&target.join("train"));
        let got = resolve_program("train", Some(&target), Some(path.clone())).unwrap();
        assert_eq!(got, target.join("train"));
        let got = resolve_program("other", Some(&target), Some(path.clone())).unwrap();
        assert_eq!(got, bin.join("other"));
        let err = resolve_program("missing", Some(&target), Some(path))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
        assert!(
            err.contains(&target.join("examples").display().to_string()),
            "{err}"
        );
        assert!(err.contains(&bin.display().to_string()), "{err}");
        // A path is taken as is, and must be executable.
        std::fs::write(root.join("plain"), "x").unwrap();
        let plain = root.join("plain").display().to_string();
        assert!(resolve_program(&plain, Some(&target), None).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
