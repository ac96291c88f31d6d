//! Helpers shared by the root end-to-end tests: building and locating `oflaunch` and the
//! `train` example, running jobs, and reading rank 0's loss lines.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// A tiny GPT: 2 blocks, width 32, 4 heads, 16-token windows, 8 per batch, no sample, a
/// line per step.
pub const TINY_GPT: [&str; 14] = [
    "--layers",
    "2",
    "--width",
    "32",
    "--heads",
    "4",
    "--seq-len",
    "16",
    "--batch-size",
    "8",
    "--gen-tokens",
    "0",
    "--log-every",
    "1",
];

/// Runs the cargo that runs the tests with `args` in the repository root.
pub fn cargo(args: &[&str]) {
    let st = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo");
    assert!(st.success(), "cargo {args:?} failed");
}

/// The release output folder of the target directory the tests use.
pub fn release_dir() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let target = if target.is_absolute() {
        target
    } else {
        root.join(target)
    };
    target.join("release")
}

/// (oflaunch, train): built once with the same cargo, release profile; or, where
/// `OXIFLOW_TEST_BINS` names a folder (a machine with the binaries but no cargo), taken from it.
pub fn binaries() -> &'static (PathBuf, PathBuf) {
    static BINS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BINS.get_or_init(|| {
        if let Some(dir) = std::env::var_os("OXIFLOW_TEST_BINS").map(PathBuf::from) {
            return (dir.join("oflaunch"), dir.join("train"));
        }
        cargo(&[
            "build",
            "--release",
            "-p",
            "oxiflow-launcher",
            "--bin",
            "oflaunch",
        ]);
        cargo(&["build", "--release", "--example", "train"]);
        let rel = release_dir();
        (rel.join("oflaunch"), rel.join("examples").join("train"))
    })
}

pub fn launch(nproc: usize, args: &[&str]) -> Output {
    let (oflaunch, train) = binaries();
    Command::new(oflaunch)
        .arg("--nproc-per-node")
        .arg(nproc.to_string())
        .arg("--backend")
        .arg("cpu")
        .arg(train)
        .args(args)
        .output()
        .expect("run oflaunch")
}

/// `launch` of the MLP classifier (`train --model mlp ARGS`).
pub fn launch_mlp(nproc: usize, args: &[&str]) -> Output {
    let mut all = vec!["--model", "mlp"];
    all.extend_from_slice(args);
    launch(nproc, &all)
}

pub fn ok(out: Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "oflaunch failed: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// Rank 0's `step N loss L` lines as (N, L).
pub fn curve(text: &str) -> Vec<(u64, f64)> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim_start_matches("[rank 0]").trim();
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("step"), Some(n), Some("loss"), Some(v)) => {
                    Some((n.parse().ok()?, v.parse().ok()?))
                }
                _ => None,
            }
        })
        .collect()
}

/// (final loss, steps/s) from the `final loss L steps/s S` line.
pub fn final_line(text: &str) -> (f64, f64) {
    let l = text
        .lines()
        .find_map(|l| l.split("final loss ").nth(1))
        .expect("final line");
    let w: Vec<&str> = l.split_whitespace().collect();
    (w[0].parse().unwrap(), w[2].parse().unwrap())
}

pub fn max_rel(a: &[(u64, f64)], b: &[(u64, f64)]) -> f64 {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    a.iter()
        .zip(b)
        .map(|((na, x), (nb, y))| {
            assert_eq!(na, nb);
            (x - y).abs() / x.abs().max(1e-12)
        })
        .fold(0.0, f64::max)
}
