//! The hostile probe's checkpoint cases, on real processes: a tiny GPT saved by a TP=2 job at
//! step 40, then damaged and resumed by `train` (a one-bit flip of `data.step` or of the
//! optimizer's step count, the optimizer section removed or emptied, one state entry removed,
//! two pieces' regions swapped, NaN weights with every checksum recomputed: each refused,
//! naming the checkpoint and the problem, before any step; a garbage manifest beside a valid
//! `<path>.old`: resumed from it with a warning naming both). And saves that hit a limit or
//! another save: a second job saving to a live job's path is refused, a held lock makes a save wait, a save
//! over the file-size limit or onto a full file system fails naming the limit and leaves no
//! `.partial`.

mod catalogue_damages;
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use catalogue_damages::{edit, flip_bit, poison};
use common::{binaries, curve, launch, TINY_GPT};
use serde_json::{json, Value};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-probe-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn sibling(p: &Path, suffix: &str) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// `train` alone (one process, one rank) with the tiny GPT and `args`.
fn train(args: &[&str]) -> Output {
    let (_, train) = binaries();
    Command::new(train)
        .args(["--model", "gpt"])
        .args(TINY_GPT)
        .args(["--seed", "9"])
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The first tensor of the manifest in `d` saved in two pieces (split over TP=2).
fn two_piece_tensor(d: &Path) -> String {
    let m: Value =
        serde_json::from_slice(&std::fs::read(d.join("manifest.json")).unwrap()).unwrap();
    m["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, t)| t["pieces"].as_array().unwrap().len() == 2)
        .map(|(name, _)| name.clone())
        .expect("a tensor split over TP=2")
}

#[test]
fn the_probe_cases_are_refused_by_train_or_fall_back_with_a_warning() {
    let root = scratch("gpt");
    let saved = root.join("step40");
    let s = saved.to_str().unwrap().to_string();
    let mut args = vec!["--model", "gpt"];
    args.extend(TINY_GPT);
    args.extend(["--seed", "9", "--tp", "2", "--steps", "40", "--save", &s]);
    let out = launch(2, &args);
    assert!(out.status.success(), "{}", text(&out).1);
    let split = two_piece_tensor(&saved);
    type Damage = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, String, Damage)> = vec![
        (
            "data.step 40 -> 50",
            "manifest checksum mismatch".into(),
            Box::new(|d| flip_bit(d, "\"data.step\": \"40\"", "\"data.step\": \"50\"")),
        ),
        (
            "optimizer step count 40 -> 50",
            "manifest checksum mismatch".into(),
            Box::new(|d| flip_bit(d, "\"step_count\": 40", "\"step_count\": 50")),
        ),
        (
            "optimizer state deleted (checksum recomputed)",
            "the checkpoint has no optimizer state".into(),
            Box::new(|d| edit(d, |m| m["optimizer"] = Value::Null)),
        ),
        (
            "optimizer state emptied (checksum recomputed)",
            "belongs to no (parameter, slot) pair".into(),
            Box::new(|d| {
                edit(d, |m| {
                    m["optimizer"]["params"] = json!([]);
                    m["optimizer"]["slots"] = json!([]);
                })
            }),
        ),
        (
            "optim/wte.weight/exp_avg_sq removed (checksum recomputed)",
            "optimizer state optim/wte.weight/exp_avg_sq is missing".into(),
            Box::new(|d| {
                edit(d, |m| {
                    m["tensors"]
                        .as_object_mut()
                        .unwrap()
                        .remove("optim/wte.weight/exp_avg_sq");
                })
            }),
        ),
        (
            "two pieces' regions swapped (checksum recomputed)",
            format!("{split}: piece 0 is"),
            Box::new(move |d| {
                let split = two_piece_tensor(d);
                edit(d, |m| {
                    let ps = m["tensors"][&split]["pieces"].clone();
                    m["tensors"][&split]["pieces"][0]["region"] = ps[1]["region"].clone();
                    m["tensors"][&split]["pieces"][1]["region"] = ps[0]["region"].clone();
                })
            }),
        ),
        (
            "NaN weights (every checksum recomputed)",
            "wte.weight: piece".into(),
            Box::new(|d| poison(d, "wte.weight", "rank-00000.safetensors")),
        ),
    ];
    for (i, (what, want, damage)) in cases.iter().enumerate() {
        let d = root.join(format!("case{i}"));
        copy_dir(&saved, &d);
        damage(&d);
        let out = train(&["--steps", "45", "--resume", d.to_str().unwrap()]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
        assert!(
            stderr.contains("checkpoint load: checkpoint ")
                && stderr.contains(d.to_str().unwrap())
                && stderr.contains(want.as_str()),
            "{what}: expected {want:?}:\n{stderr}"
        );
        assert!(curve(&stdout).is_empty(), "{what}: trained anyway");
    }
    // A garbage manifest beside a complete <path>.old: resumed from it, with a warning.
    let d = root.join("garbage");
    copy_dir(&saved, &d);
    copy_dir(&saved, &sibling(&d, ".old"));
    std::fs::write(d.join("manifest.json"), b"\x7fELF garbage").unwrap();
    let out = train(&["--steps", "42", "--resume", d.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let old = sibling(&d, ".old");
    assert!(
        stderr.contains("WARN")
            && stderr.contains(&format!("{} is not loadable", d.display()))
            && stderr.contains(&format!(
                "loading the previous checkpoint {} (step 40)",
                old.display()
            )),
        "{stderr}"
    );
    let steps: Vec<u64> = curve(&stdout).iter().map(|(n, _)| *n).collect();
    assert_eq!(steps, [41, 42], "{stdout}");
    let _ = std::fs::remove_dir_all(root);
}

fn mlp(args: &[&str]) -> Command {
    let (_, train) = binaries();
    let mut c = Command::new(train);
    c.args(["--model", "mlp"]).args(args);
    c
}

#[test]
fn a_second_job_saving_to_a_live_jobs_path_is_refused_and_saves_take_turns() {
    let root = scratch("concurrent");
    let p = root.join("ckpt");
    let ps = p.to_str().unwrap();
    // Two jobs saving to one path after every step: the path is the first one's for its whole
    // life, and the second is refused at once, naming the first's pid.
    let jobs: Vec<_> = (0..2)
        .map(|seed| {
            mlp(&[
                "--steps",
                "30",
                "--save-every",
                "1",
                "--seed",
                &seed.to_string(),
                "--save",
                ps,
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    let pids: Vec<u32> = jobs.iter().map(|j| j.id()).collect();
    let outs: Vec<_> = jobs
        .into_iter()
        .map(|j| j.wait_with_output().unwrap())
        .collect();
    let ok: Vec<usize> = (0..2).filter(|&i| outs[i].status.success()).collect();
    assert_eq!(
        ok.len(),
        1,
        "one job holds the path: {:?}",
        outs.iter().map(|o| text(o).1).collect::<Vec<_>>()
    );
    let (held, refused) = (ok[0], 1 - ok[0]);
    let why = text(&outs[refused]).1;
    assert!(
        why.contains(&format!("held by a live job (pid {} on host", pids[held])),
        "{why}"
    );
    for s in [".partial", ".lock", ".old", ".job.lock"] {
        assert!(!sibling(&p, s).exists(), "{s} left behind");
    }
    let m = oxiflow::checkpoint::read_manifest_at(&p).expect("the last save is complete");
    assert_eq!(m.metadata["step"], "30");
    // A save waits while another holds the path's lock, then completes.
    let lock = std::fs::File::create(sibling(&p, ".lock")).unwrap();
    lock.lock().unwrap();
    let t0 = Instant::now();
    let job = mlp(&["--steps", "2", "--save", ps])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    drop(lock);
    let out = job.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out).1);
    assert!(t0.elapsed() >= Duration::from_millis(1500));
    let m = oxiflow::checkpoint::read_manifest_at(&p).unwrap();
    assert_eq!(m.metadata["step"], "2");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn a_save_over_the_file_size_limit_fails_naming_it_and_leaves_no_partial() {
    let root = scratch("fsize");
    let p = root.join("ckpt");
    let (_, train) = binaries();
    // 8 blocks of 512 bytes: less than the MLP's data file.
    let script = format!(
        "ulimit -f 8 && exec '{}' --model mlp --steps 3 --save '{}'",
        train.display(),
        p.display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "not killed by SIGXFSZ: {stderr}"
    );
    assert!(
        stderr.contains(
            "exceed this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) of 4096 bytes"
        ),
        "{stderr}"
    );
    assert!(!sibling(&p, ".partial").exists(), ".partial left behind");
    assert!(!p.exists());
    // Only rank 1 of a TP=2 job is limited (6 MiB: room for its shared-memory segment, not for
    // its 12 MiB of weights and AdamW state): every rank fails the save alike, at once, naming
    // rank 1's limit, and rank 0 removes the .partial.
    let (oflaunch, _) = binaries();
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then ulimit -f 12288; fi; exec '{}' --model mlp --tp 2 \
         --features 1024 --hidden 2048 --optimizer adamw --steps 1 --save '{}'",
        train.display(),
        p.display()
    );
    let t0 = Instant::now();
    let out = Command::new(oflaunch)
        .args([
            "--nproc-per-node",
            "2",
            "--backend",
            "cpu",
            "sh",
            "-c",
            &script,
        ])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        // Rank 1 names its own failure, or rank 0 names it first while the launcher stops
        // rank 1 before its line is printed; either way the message is rank 1's.
        (stderr.contains("[rank 1] train: checkpoint write: checkpoint")
            || stderr.contains("rank 1 failed writing its checkpoint file: checkpoint write"))
            && stderr.contains("rank-00001.safetensors: ")
            && stderr.contains(
                "bytes exceed this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) of \
                 6291456 bytes"
            ),
        "{stderr}"
    );
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    assert!(!sibling(&p, ".partial").exists(), ".partial left behind");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn a_save_onto_a_full_file_system_names_the_free_space_and_leaves_no_partial() {
    let root = scratch("enospc");
    let mnt = root.join("small");
    std::fs::create_dir_all(&mnt).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=12k", "tmpfs"])
        .arg(&mnt)
        .output();
    if !mounted.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("SKIP: cannot mount a small tmpfs (needs root): {mounted:?}");
        return;
    }
    let p = mnt.join("ckpt");
    let out = mlp(&["--steps", "3", "--save", p.to_str().unwrap()])
        .output()
        .unwrap();
    let left = sibling(&p, ".partial").exists();
    let _ = Command::new("umount").arg(&mnt).status();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("No space left on device")
            && stderr.contains("bytes available on the file system of"),
        "{stderr}"
    );
    assert!(!left, ".partial left behind");
    let _ = std::fs::remove_dir_all(root);
}
