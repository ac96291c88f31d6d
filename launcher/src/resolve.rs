//! PROGRAM lookup: a path, a binary or example built beside oflaunch, or a name on PATH.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::error::LaunchError;

/// Finds the program to run. `exe_dir` is oflaunch's own folder (its target directory);
/// `path_var` is the value of PATH.
///
/// Order: a name containing '/' is a path; else `exe_dir/NAME`, `exe_dir/examples/NAME`, then
/// each PATH entry. The error lists every folder looked in, once, and the programs built
/// beside oflaunch whose names are close.
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
                hint: String::new(),
            })
        };
    }
    let mut folders: Vec<PathBuf> = Vec::new();
    if let Some(dir) = exe_dir {
        folders.push(dir.to_path_buf());
        folders.push(dir.join("examples"));
    }
    if let Some(path_var) = path_var {
        folders.extend(std::env::split_paths(&path_var).filter(|d| !d.as_os_str().is_empty()));
    }
    // A folder named twice (on PATH and as oflaunch's own, or spelled two ways) is looked in
    // once.
    let mut seen = std::collections::HashSet::new();
    folders.retain(|d| seen.insert(std::fs::canonicalize(d).unwrap_or_else(|_| d.clone())));
    if let Some(found) = folders
        .iter()
        .map(|d| d.join(name))
        .find(|c| is_executable(c))
    {
        return Ok(found);
    }
    let looked = folders
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let near = exe_dir
        .map(|dir| near_names(name, &[dir.to_path_buf(), dir.join("examples")]))
        .unwrap_or_default();
    Err(LaunchError::ProgramNotFound {
        program: name.into(),
        looked: if looked.is_empty() {
            "nowhere (no oflaunch folder, PATH unset)".into()
        } else {
            looked
        },
        hint: if near.is_empty() {
            String::new()
        } else {
            format!("; did you mean {}?", near.join(" or "))
        },
    })
}

/// The programs in `folders` whose names are at most two edits from `name`.
fn near_names(name: &str, folders: &[PathBuf]) -> Vec<String> {
    let mut near: Vec<String> = folders
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| is_executable(&e.path()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.contains('-') && edits(n, name) <= 2)
        .collect();
    near.sort();
    near.dedup();
    near
}

/// The Levenshtein distance between `a` and `b`.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
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
        // oflaunch's folder on PATH too, spelled another way: each folder named once; a close
        // name built beside oflaunch suggested.
        let twice = std::env::join_paths([target.join("."), bin.clone(), bin.clone()]).unwrap();
        let err = resolve_program("trian", Some(&target), Some(twice))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "cannot find program \"trian\"; looked in: {}, {}, {}; did you mean train?",
                target.display(),
                target.join("examples").display(),
                bin.display()
            )
        );
        assert_eq!(
            (
                edits("trian", "train"),
                edits("", "ab"),
                edits("abc", "abc")
            ),
            (2, 2, 0)
        );
        // A path is taken as is, and must be executable.
        std::fs::write(root.join("plain"), "x").unwrap();
        let plain = root.join("plain").display().to_string();
        assert!(resolve_program(&plain, Some(&target), None).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
