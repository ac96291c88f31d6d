//! The fault table: one run of real 4-rank `train` jobs on the CPU backend with faults injected
//! into rank 2 (SIGKILL and SIGSTOP during start-up, training collectives, DP2xTP2 boxing and a
//! checkpoint save) and into oflaunch itself (which serves the store). Each row records the
//! time from the fault to oflaunch's exit, the exit code, the rank and reason the summary
//! names, the workers left running afterwards, and whether the last checkpoint still resumes.
//! One more row has a rank fall behind without stopping (sleeping before a collective, in
//! oflaunch's test worker), which oflaunch names from the ranks' heartbeats.
//! The table is printed; every row is asserted.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{alive, argv, binaries, finish_job, start_job, wait_line};

const VICTIM: usize = 2;
/// Longest any fault may take to end the job (a stopped rank included).
const DETECT_LIMIT: Duration = Duration::from_secs(10);
const T: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    Kill,
    Stop,
}

#[derive(Clone, Copy)]
enum When {
    StartUp,
    Training,
    Boxing,
    Save,
}

struct Row {
    fault: String,
    detect: Duration,
    code: i32,
    named: String,
    orphans: usize,
    checkpoint: String,
}

/// Waits until a save of `ckpt` is under way (its `.partial` directory exists) after one
/// complete checkpoint was published.
fn wait_save_in_progress(ckpt: &Path) {
    let partial = PathBuf::from(format!("{}.partial", ckpt.display()));
    let t0 = Instant::now();
    while !(ckpt.join("manifest.json").exists() && partial.exists()) {
        assert!(t0.elapsed() < T, "no save under way within {T:?}");
        std::thread::yield_now();
    }
}

fn inject(pid: i32, fault: Fault) {
    let sig = match fault {
        Fault::Kill => libc::SIGKILL,
        Fault::Stop => libc::SIGSTOP,
    };
    // SAFETY: signalling a worker process of this test.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

/// What the summary names: "rank N: reason".
fn named(stderr: &str) -> String {
    stderr
        .lines()
        .find_map(|l| l.split("first failure: ").nth(1))
        .map(|l| {
            let rank = l.split(" (").next().unwrap_or(l);
            let why = l.rsplit("): ").next().unwrap_or("");
            format!("{rank}: {why}")
        })
        .unwrap_or_else(|| "nobody".into())
}

/// The training step recorded in a checkpoint's manifest.
fn saved_step(ckpt: &Path) -> Option<u64> {
    let manifest = std::fs::read_to_string(ckpt.join("manifest.json")).ok()?;
    let after = manifest.split("\"step\"").nth(1)?;
    let digits: String = after
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Whether the checkpoint resumes in a fresh 4-rank job (from its step, for 10 more steps).
fn resumes(ckpt: &Path) -> bool {
    let Some(step) = saved_step(ckpt) else {
        return false;
    };
    let (oflaunch, train) = binaries();
    let out = Command::new(oflaunch)
        .args(["--nproc-per-node", "4", "--backend", "cpu"])
        .arg(train)
        .arg("--resume")
        .arg(ckpt)
        .args(["--steps", &(step + 10).to_string()])
        .stderr(Stdio::null())
        .output();
    out.is_ok_and(|o| {
        o.status.success()
            && String::from_utf8_lossy(&o.stdout).contains(&format!("from step {step}"))
    })
}

fn run_row(fault: Fault, when: When, scratch: &Path) -> Row {
    let ckpt = scratch.join(format!("ckpt_{}", scratch.read_dir().unwrap().count()));
    let mut args: Vec<String> = ["--steps", "100000", "--log-every", "50"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if matches!(when, When::Boxing) {
        args.extend(["--dp", "2", "--tp", "2"].map(String::from));
    }
    if matches!(when, When::Save) {
        args.extend(["--save-every", "25", "--save"].map(String::from));
        args.push(ckpt.to_string_lossy().into_owned());
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let job = start_job(4, &refs);
    let workers = common::workers_of(job.child.id(), 4);
    let victim = workers[VICTIM].1;
    match when {
        When::StartUp => {}
        When::Training | When::Boxing => wait_line(&job, "step 100 loss", T),
        When::Save => wait_save_in_progress(&ckpt),
    }
    let fault_at = Instant::now();
    inject(victim, fault);
    let (detect, code, stderr) = finish_job(job, fault_at, T);
    let orphans = workers.iter().filter(|(_, pid)| alive(*pid)).count();
    let checkpoint = match when {
        When::Save if resumes(&ckpt) => "intact (resumes)".to_string(),
        When::Save => "BROKEN".to_string(),
        _ => "-".to_string(),
    };
    let what = match when {
        When::StartUp => "start-up (before the first collective)",
        When::Training => "training collectives",
        When::Boxing => "DP2xTP2 boxing",
        When::Save => "a checkpoint save",
    };
    let sig = if fault == Fault::Kill {
        "SIGKILL"
    } else {
        "SIGSTOP"
    };
    let row = Row {
        fault: format!("{sig} rank {VICTIM} during {what}"),
        detect,
        code,
        named: named(&stderr),
        orphans,
        checkpoint,
    };
    assert!(
        row.detect <= DETECT_LIMIT,
        "{}: {:?}\n{stderr}",
        row.fault,
        row.detect
    );
    assert_ne!(
        row.code, 0,
        "{}: the job reported success\n{stderr}",
        row.fault
    );
    assert_eq!(row.orphans, 0, "{}: workers left running", row.fault);
    assert!(!row.checkpoint.contains("BROKEN"), "{}", row.fault);
    // A killed rank's peers can see it gone and exit before oflaunch reaps it, so the summary
    // must name a rank but may name one of them; a stopped rank is always the one named.
    assert!(row.named.starts_with("rank "), "{}\n{stderr}", row.fault);
    if fault == Fault::Stop {
        assert_eq!(
            row.named,
            format!("rank {VICTIM}: stopped by SIGSTOP and not running for 3s; killed (exit 147)"),
            "{}\n{stderr}",
            row.fault
        );
    }
    row
}

fn store_killed_row() -> Row {
    let job = start_job(4, &["--steps", "100000", "--log-every", "50"]);
    let workers = common::workers_of(job.child.id(), 4);
    wait_line(&job, "step 100 loss", T);
    let fault_at = Instant::now();
    // SAFETY: signalling the oflaunch this test started (it serves the store).
    assert_eq!(
        unsafe { libc::kill(job.child.id() as i32, libc::SIGKILL) },
        0
    );
    let (_, code, _) = finish_job(job, fault_at, T);
    // The workers die with it (parent-death signal); time until the last is gone.
    while workers.iter().any(|(_, pid)| alive(*pid)) {
        assert!(fault_at.elapsed() < T, "workers outlived oflaunch");
        std::thread::yield_now();
    }
    let detect = fault_at.elapsed();
    assert!(detect <= DETECT_LIMIT, "{detect:?}");
    Row {
        fault: "SIGKILL oflaunch (the store) during training".into(),
        detect,
        code,
        named: "- (workers killed by the parent-death signal)".into(),
        orphans: 0,
        checkpoint: "-".into(),
    }
}

/// Rank 2 of 4 sleeps before its all-reduce number 2 while the others wait in it; the row's
/// time is from the job's start to oflaunch naming rank 2 as behind; the job then ends when
/// the waiters' 8 s collective timeout expires.
fn rank_behind_row() -> Row {
    use std::sync::mpsc::channel;
    let (oflaunch, _) = binaries();
    common::cargo(&argv(
        "build --release -p oxiflow-launcher --bin oflaunch_testworker",
    ));
    let worker = common::release_dir().join("oflaunch_testworker");
    let t0 = Instant::now();
    let mut child = Command::new(oflaunch)
        .args(argv("--nproc-per-node 4 --backend cpu --timeout 8"))
        .arg(worker)
        .args(["allreduce", "4", &VICTIM.to_string(), "2", "40"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let workers = common::workers_of(child.id(), 4);
    let err = child.stderr.take().unwrap();
    let (tx, lines) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send((Instant::now(), line));
        }
    });
    let mut named = None;
    let mut stderr = String::new();
    while let Ok((at, line)) = lines.recv_timeout(T) {
        if named.is_none() && line.contains(&format!("rank {VICTIM} is behind")) {
            named = Some((at.duration_since(t0), line.clone()));
        }
        stderr.push_str(&line);
        stderr.push('\n');
    }
    let code = child.wait().unwrap().code().unwrap_or(-1);
    let (detect, line) = named.unwrap_or_else(|| panic!("rank {VICTIM} never named\n{stderr}"));
    let orphans = workers.iter().filter(|(_, pid)| alive(*pid)).count();
    let row = Row {
        fault: format!("rank {VICTIM} behind (asleep before a collective)"),
        detect,
        code,
        named: line
            .trim_start_matches("oflaunch: ")
            .split(" (op")
            .next()
            .unwrap_or("")
            .to_string(),
        orphans,
        checkpoint: "-".into(),
    };
    assert!(row.detect <= DETECT_LIMIT, "{:?}\n{stderr}", row.detect);
    assert_ne!(row.code, 0, "{stderr}");
    assert_eq!(row.orphans, 0);
    // The first line names the waiters of that moment; the summary, all of them.
    assert!(
        stderr.contains(&format!(
            "rank {VICTIM} is behind: last entered call 1 (op all_reduce), ranks [0, 1, 3] wait \
             in call 2 (op all_reduce"
        )),
        "{stderr}"
    );
    row
}

#[test]
fn fault_table() {
    let scratch = std::env::temp_dir().join(format!("oxiflow_fault_table_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let mut rows = Vec::new();
    for fault in [Fault::Kill, Fault::Stop] {
        for when in [When::StartUp, When::Training, When::Boxing, When::Save] {
            rows.push(run_row(fault, when, &scratch));
        }
    }
    rows.push(store_killed_row());
    rows.push(rank_behind_row());
    println!(
        "\n{:<58} {:>9} {:>5}  {:<70} {:>7}  checkpoint",
        "fault", "detected", "exit", "named in the summary", "orphans"
    );
    for r in &rows {
        println!(
            "{:<58} {:>7.2}s {:>5}  {:<70} {:>7}  {}",
            r.fault,
            r.detect.as_secs_f64(),
            r.code,
            r.named,
            r.orphans,
            r.checkpoint
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
