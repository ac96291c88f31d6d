//! One crate's file graph: its modules found from the crate root's `mod` items, an edge from
//! each file to every file defining something it names (`crate::`, `super::`, `self::` and
//! child-module paths, followed through re-exports and glob imports to the defining file), and
//! the cycles among them (strongly connected components of two or more files).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use crate::lex::tokens;
use crate::parse::{facts, FileFacts, Named};

/// One file of a crate: its module path (empty for the root) and what it says.
#[derive(Debug)]
struct Module {
    path: Vec<String>,
    file: PathBuf,
    facts: FileFacts,
    /// Names imported at the top level (alias -> absolute path) and glob sources.
    imports: HashMap<String, Vec<String>>,
    globs: Vec<Vec<String>>,
}

/// The file graph of one crate.
#[derive(Debug)]
pub struct CrateGraph {
    /// The crate's name as reports print it.
    pub name: String,
    modules: Vec<Module>,
    by_path: HashMap<Vec<String>, usize>,
    /// Edges between modules (by index), deduplicated, no self edges.
    edges: BTreeMap<usize, BTreeSet<usize>>,
}

/// Most re-export hops followed from one path (a guard against import loops).
const MAX_HOPS: usize = 16;

impl CrateGraph {
    /// Reads the crate rooted at `root` (its `lib.rs` or `main.rs`), named `name`.
    pub fn read(name: &str, root: &Path) -> std::io::Result<CrateGraph> {
        let mut g = CrateGraph {
            name: name.to_string(),
            modules: Vec::new(),
            by_path: HashMap::new(),
            edges: BTreeMap::new(),
        };
        let mut todo = vec![(Vec::<String>::new(), root.to_path_buf())];
        while let Some((path, file)) = todo.pop() {
            let text = fs::read_to_string(&file)?;
            let facts = facts(&tokens(&text));
            let dir = child_dir(&file, path.is_empty());
            for m in &facts.file_mods {
                let flat = dir.join(format!("{m}.rs"));
                let nested = dir.join(m).join("mod.rs");
                let child = if flat.exists() { flat } else { nested };
                if child.exists() {
                    let mut p = path.clone();
                    p.push(m.clone());
                    todo.push((p, child));
                }
            }
            g.by_path.insert(path.clone(), g.modules.len());
            g.modules.push(Module {
                path,
                file,
                facts,
                imports: HashMap::new(),
                globs: Vec::new(),
            });
        }
        g.collect_imports();
        g.collect_edges();
        Ok(g)
    }

    /// Each module's top-level imports as absolute paths.
    fn collect_imports(&mut self) {
        for i in 0..self.modules.len() {
            let mut imports = HashMap::new();
            let mut globs = Vec::new();
            for n in &self.modules[i].facts.named {
                if !n.is_use || !n.inline.is_empty() {
                    continue;
                }
                let Some(abs) = self.absolute(i, n) else {
                    continue;
                };
                if n.glob {
                    globs.push(abs);
                } else if let Some(a) = &n.alias {
                    imports.insert(a.clone(), abs);
                }
            }
            self.modules[i].imports = imports;
            self.modules[i].globs = globs;
        }
    }

    fn collect_edges(&mut self) {
        for i in 0..self.modules.len() {
            let mut to = BTreeSet::new();
            let m = &self.modules[i];
            for n in &m.facts.named {
                // A re-export is the crate's facade: an edge only where the file itself uses
                // the name (other files resolve through it to the definer).
                let reexport_only = n.public
                    && n.alias
                        .as_ref()
                        .is_none_or(|a| !m.facts.mentions.contains(a));
                if reexport_only {
                    continue;
                }
                if let Some(abs) = self.absolute(i, n) {
                    if let Some(j) = self.definer(&abs, 0) {
                        if j != i {
                            to.insert(j);
                        }
                    }
                }
            }
            self.edges.insert(i, to);
        }
    }

    /// The absolute module path `n` names from module `i` (None: outside the crate).
    fn absolute(&self, i: usize, n: &Named) -> Option<Vec<String>> {
        let m = &self.modules[i];
        let mut here: Vec<String> = m.path.clone();
        here.extend(n.inline.iter().cloned());
        let mut segs = n.segments.iter();
        let first = segs.next()?;
        let mut base = match first.as_str() {
            "crate" => Vec::new(),
            "self" => here,
            "super" => {
                let mut b = here;
                b.pop()?;
                b
            }
            // A child module named by a `use` (uniform paths) or a name the file imported.
            name if n.is_use
                && n.inline.is_empty()
                && m.facts.file_mods.iter().any(|c| c == name) =>
            {
                let mut b = m.path.clone();
                b.push(name.to_string());
                b
            }
            _ => return None,
        };
        let rest: Vec<String> = segs.cloned().collect();
        // `super::super::x`
        let mut k = 0;
        while rest.get(k).is_some_and(|s| s == "super") {
            base.pop()?;
            k += 1;
        }
        base.extend(rest[k..].iter().cloned());
        Some(base)
    }

    /// The module whose file defines what `abs` names, following imports and globs.
    fn definer(&self, abs: &[String], hops: usize) -> Option<usize> {
        // The longest prefix that is a file module.
        let (mut at, mut used) = (self.by_path.get(&Vec::new()).copied()?, 0);
        for k in 1..=abs.len() {
            match self.by_path.get(&abs[..k]) {
                Some(&m) => (at, used) = (m, k),
                None => break,
            }
        }
        let Some(name) = abs.get(used) else {
            return Some(at);
        };
        let m = &self.modules[at];
        if hops >= MAX_HOPS
            || m.facts.defines.iter().any(|d| d == name)
            || m.facts.inline_mods.iter().any(|d| d == name)
        {
            return Some(at);
        }
        if let Some(target) = m.imports.get(name) {
            let mut p = target.clone();
            p.extend(abs[used + 1..].iter().cloned());
            return self.definer(&p, hops + 1).or(Some(at));
        }
        for g in &m.globs {
            let mut p = g.clone();
            p.extend(abs[used..].iter().cloned());
            if let Some(j) = self.definer(&p, hops + 1) {
                let found = &self.modules[j];
                if found.facts.defines.iter().any(|d| d == name) || found.imports.contains_key(name)
                {
                    return Some(j);
                }
            }
        }
        // A `#[macro_export]` macro lives at the root, defined wherever its file is.
        if m.path.is_empty() {
            if let Some(j) = self
                .modules
                .iter()
                .position(|x| x.facts.defines.iter().any(|d| d == name))
            {
                return Some(j);
            }
        }
        Some(at)
    }

    /// The cycles: strongly connected components of two or more files, each as its files'
    /// paths relative to `base`, sorted.
    pub fn cycles(&self, base: &Path) -> Vec<Vec<String>> {
        let mut out: Vec<Vec<String>> = strongly_connected(self.modules.len(), &self.edges)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|c| {
                let mut files: Vec<String> = c
                    .iter()
                    .map(|&i| {
                        let f = &self.modules[i].file;
                        f.strip_prefix(base).unwrap_or(f).display().to_string()
                    })
                    .collect();
                files.sort();
                files
            })
            .collect();
        out.sort();
        out
    }

    /// Number of files read.
    pub fn files(&self) -> usize {
        self.modules.len()
    }

    /// The files `file` (relative to `base`) imports from, relative to `base`.
    pub fn imports_of(&self, base: &Path, file: &str) -> Vec<String> {
        let Some(i) = self
            .modules
            .iter()
            .position(|m| m.file.strip_prefix(base).unwrap_or(&m.file) == Path::new(file))
        else {
            return Vec::new();
        };
        self.edges
            .get(&i)
            .into_iter()
            .flatten()
            .map(|&j| {
                let f = &self.modules[j].file;
                f.strip_prefix(base).unwrap_or(f).display().to_string()
            })
            .collect()
    }
}

/// The directory a module file's children live in: beside a root or `mod.rs`, else in the
/// folder named after the file.
fn child_dir(file: &Path, root: bool) -> PathBuf {
    let parent = file.parent().unwrap_or(Path::new(".")).to_path_buf();
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    if root || stem == "mod" {
        parent
    } else {
        parent.join(stem)
    }
}

/// Tarjan's strongly connected components of a graph of `n` nodes.
fn strongly_connected(n: usize, edges: &BTreeMap<usize, BTreeSet<usize>>) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a BTreeMap<usize, BTreeSet<usize>>,
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        let succ: Vec<usize> = s.edges.get(&v).into_iter().flatten().copied().collect();
        for w in succ {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(comp);
        }
    }
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A crate of `files` (path, text) written under a fresh temporary folder.
    fn crate_of(tag: &str, files: &[(&str, &str)]) -> (PathBuf, CrateGraph) {
        let dir = std::env::temp_dir().join(format!("module-graph-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for (p, text) in files {
            let f = dir.join(p);
            fs::create_dir_all(f.parent().unwrap()).unwrap();
            fs::write(f, text).unwrap();
        }
        let g = CrateGraph::read(tag, &dir.join("lib.rs")).unwrap();
        (dir, g)
    }

    #[test]
    fn a_ring_is_a_cycle_and_a_stack_is_not() {
        let (dir, g) = crate_of(
            "ring",
            &[
                ("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::A;\n"),
                ("a.rs", "use crate::b::B;\npub struct A;"),
                ("b.rs", "pub struct B(crate::c::C);"),
                ("c.rs", "use super::A;\npub struct C;"),
            ],
        );
        assert_eq!(g.cycles(&dir), vec![vec!["a.rs", "b.rs", "c.rs"]]);
        let (dir, g) = crate_of(
            "stack",
            &[
                ("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::A;\n"),
                ("a.rs", "use crate::b::B;\npub struct A;"),
                ("b.rs", "pub struct B(crate::c::C);"),
                (
                    "c.rs",
                    "pub struct C;\n#[cfg(test)]\nmod tests { use super::*; }",
                ),
            ],
        );
        assert!(g.cycles(&dir).is_empty(), "{:?}", g.cycles(&dir));
    }

    #[test]
    fn re_exports_and_globs_lead_to_the_defining_file() {
        let (dir, g) = crate_of(
            "reexport",
            &[
                (
                    "lib.rs",
                    "mod error;\nmod op;\nmod tensor;\npub use error::Result;\n",
                ),
                (
                    "error.rs",
                    "pub type Result<T> = std::result::Result<T, ()>;",
                ),
                (
                    "op/mod.rs",
                    "mod matmul;\npub use matmul::*;\nuse crate::Result;",
                ),
                (
                    "op/matmul.rs",
                    "pub struct Matmul;\nuse crate::tensor::Tensor;",
                ),
                ("tensor.rs", "pub struct Tensor(crate::op::Matmul);"),
            ],
        );
        // lib.rs is never a definer of `Result`; tensor.rs reaches matmul.rs through the glob
        // re-export, which is no edge of op/mod.rs's own.
        assert_eq!(g.imports_of(&dir, "op/mod.rs"), vec!["error.rs"]);
        assert_eq!(g.imports_of(&dir, "tensor.rs"), vec!["op/matmul.rs"]);
        assert_eq!(g.cycles(&dir), vec![vec!["op/matmul.rs", "tensor.rs"]]);
    }
}
