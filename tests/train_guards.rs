//! The health guards of `train`, on real processes: `--lr 1000` stops with a non-finite error
//! naming the step and the first non-finite tensor (exit code 3, every rank the same message,
//! after a warning that the loss grew past 4 x its lowest), and the checkpoint saved every step
//! is the last good one, whole (a run that only generates loads it); `--on-nonfinite skip` drops such steps' updates
//! and stops after 10 in a row; a checkpoint holding a NaN is refused on resume (also under
//! `--allow-resume-mismatch` and `--resume auto`); `--allow-resume-mismatch` means the same for
//! the GPT as for the MLP (a seed mismatch) and starts another optimizer fresh, saying so.

mod catalogue_damages;
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use catalogue_damages::poison;
use common::{argv, binaries, curve, launch, TINY_GPT};
use oxiflow::checkpoint;

fn tmp(name: &str) -> PathBuf {
    common::scratch_dir("guards", name)
}

fn train(args: &[&str]) -> Output {
    Command::new(&binaries().1).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The step a non-finite error names (`step N: non-finite ...`), from a line holding `prefix`.
fn stopped_at(stderr: &str, prefix: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.contains(prefix) && l.contains(": non-finite "))
        .unwrap_or_else(|| panic!("no non-finite error: {stderr}"));
    let after = line.split("train: step ").nth(1).expect("step");
    after.split(':').next().unwrap().parse().unwrap()
}

fn saved_step(path: &Path) -> u64 {
    checkpoint::read_manifest_at(path).unwrap().metadata["step"]
        .parse()
        .unwrap()
}

#[test]
fn lr_1000_stops_naming_the_step_and_the_tensor() {
    let out = train(&["--lr", "1000", "--gen-tokens", "0", "--log-every", "1"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let n = stopped_at(&stderr, "train: step");
    assert!(
        stderr.contains(&format!("train: step {n}: non-finite "))
            && stderr.contains("the first non-finite tensor: ")
            && stderr.contains("stopped before the update"),
        "{stderr}"
    );
    assert!(
        stderr.contains("WARN step 2: loss ")
            && stderr.contains("is above 4 x the lowest smoothed loss"),
        "no spike warning: {stderr}"
    );
    let steps: Vec<u64> = curve(&stdout).iter().map(|c| c.0).collect();
    assert_eq!(steps, (1..n).collect::<Vec<_>>(), "{stdout}");
    assert!(!stdout.contains("final loss"), "{stdout}");
    eprintln!("train --lr 1000: {}", stderr.lines().last().unwrap_or(""));
}

#[test]
fn every_rank_stops_alike_and_the_last_good_checkpoint_is_whole() {
    let dir = tmp("lr1000");
    let ck = dir.join("ck");
    let cks = ck.to_str().unwrap();
    let mut args = TINY_GPT.to_vec();
    args.extend_from_slice(&[
        "--lr",
        "1000",
        "--steps",
        "40",
        "--save",
        cks,
        "--save-every",
        "1",
    ]);
    let out = launch(2, &args);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let n = stopped_at(&stderr, "train: step");
    // oflaunch stops the others at the first failure, so a rank may not get to say why; those
    // that do say the same (trainer/tests/health.rs checks every rank in one process).
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("] train: step"))
        .map(|l| l.split_once("] ").unwrap().1)
        .collect();
    assert!(
        !errors.is_empty() && errors.iter().all(|e| *e == errors[0]),
        "the ranks disagree: {errors:?}"
    );
    // Every good step was saved; the bad one and nothing after it.
    let at = saved_step(&ck);
    assert!(at < n, "a checkpoint of step {at} after the bad step {n}");
    assert_eq!(at, n - 1, "the last good step {} was not saved", n - 1);
    assert!(!dir.join("ck.partial").exists(), "a .partial was left");
    // The last good checkpoint loads whole (every value finite, every piece there): a run
    // that only generates from it starts.
    // The model's sizes only: a run that only generates refuses training flags.
    let mut sample = TINY_GPT[..8].to_vec();
    sample.extend_from_slice(&["--resume", cks, "--generate", "The ", "--gen-tokens", "4"]);
    let out = train(&sample);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("sample (temperature"),
        "{}",
        text(&out.stdout)
    );
    eprintln!("oflaunch 2 --lr 1000: stopped at step {n}, checkpoint at step {at}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn skip_drops_non_finite_steps_and_stops_after_ten_in_a_row() {
    let out = train(&argv(
        "--model mlp --lr 1000 --steps 60 --log-every 1 --on-nonfinite skip",
    ));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let skipped: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(" skipped: "))
        .collect();
    assert_eq!(skipped.len(), 9, "{stdout}");
    assert!(
        skipped[0].contains("the first non-finite tensor: the loss"),
        "{stdout}"
    );
    assert!(stderr.contains("10 non-finite steps in a row"), "{stderr}");
}

/// A fresh MLP checkpoint of 3 steps at `dir/ck`.
fn mlp_checkpoint(dir: &Path, optimizer: &str) -> PathBuf {
    let ck = dir.join("ck");
    let out = train(&[
        "--model",
        "mlp",
        "--steps",
        "3",
        "--optimizer",
        optimizer,
        "--save",
        ck.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    ck
}

#[test]
fn a_checkpoint_holding_nan_is_refused_on_resume() {
    let dir = tmp("nan");
    let ck = mlp_checkpoint(&dir, "sgd");
    let cks = ck.to_str().unwrap();
    let fc1 = checkpoint::read_manifest_at(&ck)
        .unwrap()
        .tensors
        .keys()
        .find(|k| k.ends_with("fc1.weight") && !k.starts_with("optim/"))
        .cloned()
        .expect("the fc1 weight");
    poison(&ck, &fc1, "rank-00000.safetensors");
    let cases: [&[&str]; 3] = [
        &["--resume", cks],
        &["--resume", cks, "--allow-resume-mismatch"],
        &["--resume", "auto", "--save", cks],
    ];
    for args in cases {
        let mut all = vec!["--model", "mlp", "--steps", "6"];
        all.extend_from_slice(args);
        let out = train(&all);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&fc1) && stderr.contains("non-finite"),
            "{args:?}: {stderr}"
        );
        assert!(curve(&text(&out.stdout)).is_empty(), "{args:?} trained");
        eprintln!("{args:?}: {}", stderr.trim_end());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn allow_resume_mismatch_means_the_same_for_every_model() {
    let dir = tmp("mismatch");
    // The GPT: a checkpoint of seed 0 resumed with seed 5.
    let ck = dir.join("gpt");
    let cks = ck.to_str().unwrap();
    let mut args = TINY_GPT.to_vec();
    args.extend_from_slice(&["--steps", "2", "--save", cks]);
    assert!(train(&args).status.success());
    let mut resume = TINY_GPT.to_vec();
    resume.extend_from_slice(&["--steps", "3", "--resume", cks, "--seed", "5"]);
    let refused = train(&resume);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        text(&refused.stderr).contains("saved with seed 0 but this run has --seed 5"),
        "{}",
        text(&refused.stderr)
    );
    resume.push("--allow-resume-mismatch");
    let allowed = train(&resume);
    assert!(allowed.status.success(), "{}", text(&allowed.stderr));
    assert_eq!(curve(&text(&allowed.stdout)).first().map(|c| c.0), Some(3));
    // The MLP: an SGD checkpoint resumed with AdamW starts AdamW fresh, naming what it reset.
    let ck = mlp_checkpoint(&dir, "sgd");
    let cks = ck.to_str().unwrap();
    let adamw = [
        "--model",
        "mlp",
        "--steps",
        "5",
        "--log-every",
        "1",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--resume",
        cks,
    ];
    let refused = train(&adamw);
    assert_eq!(refused.status.code(), Some(1));
    assert!(text(&refused.stderr).contains("optimizer sgd"));
    let mut all = adamw.to_vec();
    all.push("--allow-resume-mismatch");
    let allowed = train(&all);
    let stderr = text(&allowed.stderr);
    assert!(allowed.status.success(), "{stderr}");
    assert!(
        stderr.contains("started fresh") && stderr.contains("exp_avg"),
        "{stderr}"
    );
    assert_eq!(curve(&text(&allowed.stdout)).first().map(|c| c.0), Some(4));
    let _ = std::fs::remove_dir_all(&dir);
}
