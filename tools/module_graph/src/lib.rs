//! The workspace's module import graph: for every crate (the workspace members, the root
//! package, each binary), which of its source files import which (`use crate::…`, `super::…`,
//! child-module paths and qualified paths in code, followed through re-exports to the file
//! that defines the item), and the cycles among them: files that import each other in a loop.
//!
//! ```text
//! cargo run -p oxiflow-module-graph            # every crate's cycles
//! cargo test -p oxiflow-module-graph            # and the checks on them
//! ```

mod graph;
mod lex;
mod parse;

use std::fs;
use std::path::{Path, PathBuf};

pub use graph::CrateGraph;

/// Every crate root of the workspace at `root`: (name, root file) of the root package, each
/// member's library, and every binary under a `src/bin/`.
pub fn crate_roots(root: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let manifest = fs::read_to_string(root.join("Cargo.toml"))?;
    let mut dirs = vec![PathBuf::from(".")];
    dirs.extend(members(&manifest).into_iter().map(PathBuf::from));
    let mut out = Vec::new();
    for d in dirs {
        let src = root.join(&d).join("src");
        for main in ["lib.rs", "main.rs"] {
            if src.join(main).exists() {
                out.push((d.display().to_string(), src.join(main)));
            }
        }
        if let Ok(bins) = fs::read_dir(src.join("bin")) {
            let mut bins: Vec<PathBuf> = bins
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "rs"))
                .collect();
            bins.sort();
            for b in bins {
                let stem = b.file_stem().and_then(|s| s.to_str()).unwrap_or("bin");
                out.push((format!("{} (bin {stem})", d.display()), b));
            }
        }
    }
    Ok(out)
}

/// The workspace members listed in a manifest's `members = [..]`.
fn members(manifest: &str) -> Vec<String> {
    let Some(start) = manifest.find("members") else {
        return Vec::new();
    };
    let rest = &manifest[start..];
    let (Some(open), Some(close)) = (rest.find('['), rest.find(']')) else {
        return Vec::new();
    };
    rest[open + 1..close]
        .split(',')
        .map(|s| s.trim().trim_matches('"').to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Every crate's graph, in [`crate_roots`] order.
pub fn workspace_graphs(root: &Path) -> std::io::Result<Vec<CrateGraph>> {
    crate_roots(root)?
        .iter()
        .map(|(name, file)| CrateGraph::read(name, file))
        .collect()
}

/// The workspace root this crate sits in (two folders up).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_read_from_the_manifest() {
        let m = "[workspace]\nmembers = [\"dtype\", \"tools/x\",\n \"ops\"]\nresolver = \"2\"";
        assert_eq!(members(m), ["dtype", "tools/x", "ops"]);
    }
}
