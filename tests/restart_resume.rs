//! Restarts that resume (torchrun elastic's contract): `oflaunch --max-restarts 2` runs
//! `train --save DIR --resume auto`; the first start finds no checkpoint and starts fresh, a
//! worker is SIGKILLed mid-run, and the restarted job resumes from the newest complete
//! checkpoint in DIR and ends exactly where an uninterrupted run ends: the same final losses
//! and bit-identical final checkpoint files.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{alive, binaries, curve, workers_of};

const STEPS: &str = "1000";
const EVERY: u64 = 50;
/// The restarted job is killed once a checkpoint at this step or later is published.
const KILL_AFTER: u64 = 150;
const T: Duration = Duration::from_secs(300);

fn args(dir: &Path) -> Vec<String> {
    [
        "--model",
        "mlp",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--steps",
        STEPS,
        "--log-every",
        "10",
        "--save-every",
        &EVERY.to_string(),
        "--save",
        dir.to_str().unwrap(),
        "--resume",
        "auto",
    ]
    .map(String::from)
    .to_vec()
}

fn oflaunch(extra: &[&str], dir: &Path) -> Command {
    let (oflaunch, train) = binaries();
    let mut c = Command::new(oflaunch);
    c.args(["--nproc-per-node", "2", "--backend", "cpu"])
        .args(extra)
        .arg(train)
        .args(args(dir));
    c
}

/// The `step` of the checkpoint published at `dir`, if one is there now.
fn saved_step(dir: &Path) -> Option<u64> {
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).ok()?).ok()?;
    m["metadata"]["step"].as_str()?.parse().ok()
}

/// The `from step N` of each start's header line.
fn starts(stdout: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter_map(|l| l.split(" from step ").nth(1)?.trim().parse().ok())
        .collect()
}

fn data_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_killed_worker_is_restarted_from_the_last_checkpoint_and_ends_at_the_same_loss() {
    let root = std::env::temp_dir().join(format!("oxiflow-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let (whole, restarted) = (root.join("whole"), root.join("restarted"));

    let out = oflaunch(&[], &whole).output().unwrap();
    let uninterrupted = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        starts(&uninterrupted),
        [0],
        "a first start with no checkpoint is fresh"
    );

    let mut job = oflaunch(&["--max-restarts", "2"], &restarted)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = job.stdout.take().unwrap();
    let stdout = std::thread::spawn(move || {
        BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
            .join("\n")
    });
    let workers = workers_of(job.id(), 2);
    let t0 = Instant::now();
    let killed_after = loop {
        if let Some(step) = saved_step(&restarted).filter(|&s| s >= KILL_AFTER) {
            break step;
        }
        assert!(t0.elapsed() < T, "no checkpoint at step {KILL_AFTER}");
        std::thread::sleep(Duration::from_millis(2));
    };
    // SAFETY: signalling a worker of this test's job.
    assert_eq!(unsafe { libc::kill(workers[1].1, libc::SIGKILL) }, 0);
    let status = job.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut job.stderr.take().unwrap(), &mut stderr).unwrap();
    let resumed = stdout.join().unwrap();
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("oflaunch: restarting the workers (1/2)"),
        "{stderr}"
    );
    assert!(stderr.contains("first failure: rank 1"), "{stderr}");
    let from = starts(&resumed);
    eprintln!("killed after the checkpoint of step {killed_after}; starts: {from:?}");
    assert_eq!(from.len(), 2, "{resumed}");
    assert_eq!(from[0], 0);
    assert!(
        from[1] >= killed_after && from[1].is_multiple_of(EVERY),
        "resumed from step {} after the checkpoint of step {killed_after}",
        from[1]
    );
    // The continued curve is the uninterrupted one, digit for digit, to the end.
    let (a, b) = (curve(&uninterrupted), curve(&resumed));
    let tail = |c: &[(u64, f64)]| -> Vec<(u64, f64)> {
        c.iter().copied().filter(|(n, _)| *n > from[1]).collect()
    };
    assert_eq!(tail(&a), tail(&b));
    let last = |t: &str| {
        t.lines().find(|l| l.contains("final loss")).map(|l| {
            l.split("final loss ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .to_string()
        })
    };
    assert_eq!(last(&uninterrupted), last(&resumed));
    assert_eq!(
        data_files(&whole),
        data_files(&restarted),
        "final checkpoints differ"
    );
    for (rank, pid) in workers {
        assert!(!alive(pid), "rank {rank} left running");
    }
    let _ = std::fs::remove_dir_all(root);
}
