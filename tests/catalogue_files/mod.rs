//! The file part of the hostile catalogue of `train`: outputs aimed at inputs (the same file
//! by name, `./name`, a hard link, a symlink, a symlinked folder; a checkpoint's own files; one
//! path for two outputs), outputs of other runs, token files with damaged or misleading headers
//! (u16 and u32 ids), tokenizer.json files that cannot be used, resumes onto other data, batch
//! sizes, tokenizers (by name or by a file's hash) or shard sets, and checkpoints whose
//! manifests were edited with their checksum recomputed. Each case runs in a folder holding
//! real inputs (a text corpus, token shards, a job file, checkpoints, the metrics and plot of
//! another run) and must be refused before training, naming the fragment given, with every file
//! of the folder byte-identical afterwards and no file added or removed.

mod cases;
mod flows;
mod inputs;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{not_refused, run_limited, Ended, CASE_LIMIT};
use cases::cases;
pub use flows::own_outputs_and_live_saves;
use inputs::Inputs;

/// Everything under `dir`: each path with what it is (a file's bytes, a symlink's target, a
/// folder).
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let what = if m.is_symlink() {
                let mut v = b"link ".to_vec();
                v.extend(std::fs::read_link(&p).unwrap().to_string_lossy().bytes());
                v
            } else if m.is_dir() {
                todo.push(p.clone());
                b"folder".to_vec()
            } else if m.is_file() {
                std::fs::read(&p).unwrap()
            } else {
                b"special".to_vec()
            };
            out.insert(p.strip_prefix(dir).unwrap().to_path_buf(), what);
        }
    }
    out
}

/// What differs between two snapshots, if anything.
pub fn changes(
    before: &BTreeMap<PathBuf, Vec<u8>>,
    after: &BTreeMap<PathBuf, Vec<u8>>,
) -> Vec<String> {
    let mut v = Vec::new();
    for (p, b) in before {
        match after.get(p) {
            None => v.push(format!("{} was removed", p.display())),
            Some(a) if a != b => v.push(format!("{} was changed", p.display())),
            _ => {}
        }
    }
    for p in after.keys().filter(|p| !before.contains_key(*p)) {
        v.push(format!("{} was created", p.display()));
    }
    v
}
/// Runs every case with `train`; returns the failures and the number of cases.
pub fn run_all(train: &Path) -> (Vec<String>, usize) {
    let inputs = Inputs::new("single", train);
    let mut failures = Vec::new();
    let cases = cases();
    for (args, want) in &cases {
        let before = snapshot(&inputs.0);
        let mut cmd = Command::new(train);
        cmd.args(args).current_dir(&inputs.0);
        let e: Ended = run_limited(cmd, CASE_LIMIT * 2);
        let what = format!("train {args:?}");
        if let Some(why) = not_refused(&e, want) {
            failures.push(format!("{what}: {why}\n  stderr: {}", e.stderr.trim_end()));
        }
        let changed = changes(&before, &snapshot(&inputs.0));
        if !changed.is_empty() {
            failures.push(format!("{what}: {}", changed.join(", ")));
        }
        let said = e.stderr.lines().find(|l| l.contains(want)).unwrap_or("");
        eprintln!("{args:?}: {said}");
    }
    (failures, cases.len())
}
