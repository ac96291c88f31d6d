//! Helpers shared by the root end-to-end tests: building and locating `oflaunch` and the
//! `train` example, running jobs, and reading rank 0's loss lines.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;

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

/// A command line written as one string (`"--pp 2 --micro-batches 4"`), split at white space
/// into its arguments; arguments that are empty or hold white space are written as lists.
pub fn argv(line: &'static str) -> Vec<&'static str> {
    line.split_ascii_whitespace().collect()
}

/// `train --from-hf DIR --data DATA` in f64 on 16-token windows, 4 per batch, no sample, with
/// `extra`.
pub fn from_hf<'a>(dir: &'a str, data: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["--from-hf", dir, "--data", data];
    a.extend(argv(
        "--seq-len 16 --batch-size 4 --dtype f64 --gen-tokens 0",
    ));
    a.extend_from_slice(extra);
    a
}

/// Rank `rank` of a 2-rank job started alone with `args`, with no rendezvous to reach.
pub fn rank_alone(bin: &Path, args: &[&str], rank: &str) -> Output {
    Command::new(bin)
        .args(args)
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env("RANK", rank)
        .env("LOCAL_RANK", rank)
        .env("WORLD_SIZE", "2")
        .output()
        .expect("run one rank alone")
}

/// `bin ARGS` run in `dir`, which must succeed; returns its stdout.
pub fn succeed_in(bin: &Path, dir: &Path, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run the binary");
    assert!(
        out.status.success(),
        "{} {args:?}: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `train --from-hf DIR --eval-only --data DATA` in f64 on 16-token windows, 3 per batch, with
/// `extra`, on `nproc` ranks, which must succeed: rank 0's output.
pub fn eval_hf_text(nproc: usize, dir: &str, data: &str, extra: &[&str]) -> String {
    let mut args = vec!["--from-hf", dir, "--eval-only", "--data", data];
    args.extend(argv("--seq-len 16 --batch-size 3 --dtype f64"));
    args.extend_from_slice(extra);
    ok(launch(nproc, &args))
}

/// [`eval_hf_text`] of the checkpoint in `dir` on the fixture tokens of `tests/fixtures/hf`.
pub fn eval_fixture_text(nproc: usize, dir: &Path, extra: &[&str]) -> String {
    let data = hf_fixtures().join("tokens.bin");
    eval_hf_text(nproc, dir.to_str().unwrap(), data.to_str().unwrap(), extra)
}

/// [`eval_hf_text`]'s (loss, tokens) from rank 0's `eval loss L over N tokens` line.
pub fn eval_hf(nproc: usize, dir: &str, data: &str, extra: &[&str]) -> (f64, usize) {
    let text = eval_hf_text(nproc, dir, data, extra);
    let l = text
        .lines()
        .find_map(|l| l.split("eval loss ").nth(1))
        .unwrap_or_else(|| panic!("no eval line in {text}"));
    let w: Vec<&str> = l.split_whitespace().collect();
    (w[0].parse().unwrap(), w[2].parse().unwrap())
}

/// `launch` of the MLP classifier (`train --model mlp ARGS`).
pub fn launch_mlp(nproc: usize, args: &[&str]) -> Output {
    let mut all = vec!["--model", "mlp"];
    all.extend_from_slice(args);
    launch(nproc, &all)
}

/// Asserts that `train args` on `nproc` ranks is refused: the job fails, its error names
/// `want`, and no step ran.
pub fn assert_refused(nproc: usize, args: &[&str], want: &str) {
    let out = launch(nproc, args);
    let (so, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{args:?} was accepted");
    assert!(err.contains(want), "{args:?}: {err}");
    assert!(curve(&so).is_empty(), "{args:?} ran a step: {so}");
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

/// Rank 0's stdout of a finished `oflaunch`, or an error naming `what`, the exit status and
/// the last 12 lines of stderr.
pub fn stdout_or_tail(out: std::io::Result<Output>, what: &str) -> Result<String, String> {
    let out = out.map_err(|e| format!("oflaunch: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(12).collect();
        return Err(format!(
            "{what} failed ({}): {}",
            out.status,
            tail.join(" | ")
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The number the crash tests give a save stage: 1 mid-file, 2 before publish, 3 between
/// renames.
pub fn save_stage_code(stage: oxiflow::checkpoint::SaveStage) -> u8 {
    use oxiflow::checkpoint::SaveStage;
    match stage {
        SaveStage::MidFile => 1,
        SaveStage::BeforePublish => 2,
        SaveStage::BetweenRenames => 3,
    }
}

/// The values of the MLP classifier's parameters, in order.
pub fn classifier_values(c: &oxiflow::trainer::tasks::mlp::Classifier) -> Vec<Vec<f32>> {
    use oxiflow::nn::Module;
    c.model
        .parameters()
        .iter()
        .map(|p| p.value().to_vec::<f32>().unwrap())
        .collect()
}

/// Asserts that curve `got` is within relative `tol` of `want` ([`max_rel`]), printing the
/// difference under `what`.
pub fn assert_close(
    what: impl std::fmt::Display,
    want: &[(u64, f64)],
    got: &[(u64, f64)],
    tol: f64,
) {
    let diff = max_rel(want, got);
    eprintln!("{what}: max relative difference {diff:.3e}");
    assert!(diff <= tol, "{what} differs by {diff:e}");
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

/// Freezes `pid`'s main thread as a debugger does (PTRACE_SEIZE, then PTRACE_INTERRUPT): its
/// other threads (the heartbeat) run on. The returned thread stays its tracer and collects its
/// ptrace events without ever resuming it, until it dies (a killed tracee is handed to its
/// parent only once its tracer has seen it die). Returns it with its thread id (the tracer's
/// pid as `/proc/PID/status` names it).
pub fn ptrace_freeze(pid: i32) -> (std::thread::JoinHandle<()>, i32) {
    let (tx, rx) = std::sync::mpsc::channel();
    let tracer = std::thread::spawn(move || {
        let null = std::ptr::null_mut::<libc::c_void>();
        // SAFETY: PTRACE_SEIZE and PTRACE_INTERRUPT on a process of this test; no memory is
        // passed (the address and data arguments are null).
        let seized = unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, null, null) };
        // SAFETY: as above.
        let stopped =
            seized == 0 && unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, pid, null, null) } == 0;
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let _ = tx.send(
            stopped
                .then_some(tid)
                .ok_or_else(std::io::Error::last_os_error),
        );
        if !stopped {
            return;
        }
        loop {
            let mut status = 0;
            // SAFETY: waitpid on the tracee with a pointer to a local status word.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
            if r < 0 || libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                return;
            }
        }
    });
    let tid = rx.recv().unwrap().expect("ptrace the worker");
    (tracer, tid)
}

/// Whether a process with this pid exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    matches!(state, Some(s) if s != 'Z' && s != 'X')
}

/// The workers oflaunch `pid` started, as (rank, pid), once `n` exist.
pub fn workers_of(pid: u32, n: usize) -> Vec<(usize, i32)> {
    let t0 = std::time::Instant::now();
    loop {
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        let mut found: Vec<(usize, i32)> = children
            .split_whitespace()
            .filter_map(|c| c.parse::<i32>().ok())
            .filter_map(|child| {
                let env = std::fs::read(format!("/proc/{child}/environ")).ok()?;
                let rank = env
                    .split(|&b| b == 0)
                    .find_map(|kv| kv.strip_prefix(b"RANK="))
                    .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok())?;
                Some((rank, child))
            })
            .collect();
        if found.len() == n {
            found.sort_unstable();
            return found;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "the workers did not start: {found:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A GPT of the tests with `layers` blocks, `width` wide, 4 heads, `seq_len`-token windows,
/// 8 per batch, no sample, the loss every step.
pub const fn gpt_flags(
    layers: &'static str,
    width: &'static str,
    seq_len: &'static str,
) -> [&'static str; 14] {
    [
        "--layers",
        layers,
        "--width",
        width,
        "--heads",
        "4",
        "--seq-len",
        seq_len,
        "--batch-size",
        "8",
        "--gen-tokens",
        "0",
        "--log-every",
        "1",
    ]
}

/// The tiny GPT of the tests: 2 blocks, width 32, 16-token windows.
pub const TINY_GPT: [&str; 14] = gpt_flags("2", "32", "16");

/// The GPT of the GPU suites: 4 blocks (PP2 x 2 chunks), width 64, 32-token windows (the
/// suites add `--steps`).
pub const GPU_GPT: [&str; 14] = gpt_flags("4", "64", "32");

/// A running `oflaunch ... train` job: its stdout lines as they come, its stderr at the end.
pub struct Job {
    pub child: std::process::Child,
    pub lines: std::sync::mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

/// `cmd` started with no stdin, its stdout and stderr piped to this process.
pub fn spawn_piped(cmd: &mut Command) -> std::io::Result<Child> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
}

/// Starts `oflaunch --nproc-per-node N --backend cpu train ARGS`.
pub fn start_job(nproc: usize, train_args: &[&str]) -> Job {
    use std::io::BufRead;
    let (oflaunch, train) = binaries();
    let mut child = spawn_piped(
        Command::new(oflaunch)
            .args(["--nproc-per-node", &nproc.to_string(), "--backend", "cpu"])
            .arg(train)
            .args(train_args),
    )
    .expect("start oflaunch");
    let out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    Job {
        child,
        lines,
        stderr,
    }
}

/// Waits (up to `limit`) for a stdout line of `job` containing `what`; a job that ends first
/// is a failure showing its output.
pub fn wait_line(job: &Job, what: &str, limit: std::time::Duration) {
    use std::sync::mpsc::RecvTimeoutError;
    let deadline = std::time::Instant::now() + limit;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match job.lines.recv_timeout(left) {
            Ok(line) if line.contains(what) => return,
            Ok(line) => seen.push(line),
            Err(RecvTimeoutError::Timeout) => panic!("no line with {what:?} within {limit:?}"),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("the job ended before {what:?}:\n{}", seen.join("\n"))
            }
        }
    }
}

/// Waits (up to `limit` after `since`) for `job` to end; returns (time since `since`, exit
/// code, stderr).
pub fn finish_job(
    mut job: Job,
    since: std::time::Instant,
    limit: std::time::Duration,
) -> (std::time::Duration, i32, String) {
    let status = loop {
        if let Some(s) = job.child.try_wait().expect("wait for oflaunch") {
            break s;
        }
        if since.elapsed() > limit {
            let _ = job.child.kill();
            panic!("oflaunch still running {limit:?} after the fault");
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    let took = since.elapsed();
    let stderr = job.stderr.join().expect("stderr reader");
    (took, status.code().unwrap_or(-1), stderr)
}

/// A fresh, empty scratch folder `oxiflow-{suite}-{pid}-{name}` in the temporary directory.
pub fn scratch_dir(suite: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The Hugging Face fixtures (`tests/fixtures/hf`, made by `scripts/hf_fixtures.py`).
pub fn hf_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

/// A copy of Hugging Face fixture `name` under `dir`.
pub fn hf_fixture_copy(name: &str, dir: &Path) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(hf_fixtures().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to
}

/// Sets `key` of the model directory `dir`'s `config.json` to `value`.
pub fn set_hf_config(dir: &Path, key: &str, value: serde_json::Value) {
    let p = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    c[key] = value;
    std::fs::write(&p, serde_json::to_string(&c).unwrap()).unwrap();
}

/// transformers' reference values for fixture `model` (`reference.json`'s `models` entry).
pub fn hf_reference(model: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(hf_fixtures().join("reference.json")).unwrap();
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    r["models"][model].clone()
}

/// `--from-hf DIR` greedy generation of 24 tokens in f64 after `prompts` (`--prompt-ids`),
/// with `extra`.
pub fn greedy_hf<'a>(dir: &'a str, prompts: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["--from-hf", dir, "--prompt-ids", prompts];
    a.extend(argv("--gen-tokens 24 --temperature 0 --dtype f64"));
    a.extend_from_slice(extra);
    a
}

/// transformers' greedy ids for fixture `model`, one list per prompt.
pub fn hf_greedy_ids(model: &str) -> Vec<Vec<u64>> {
    let ids = |g: &serde_json::Value| -> Vec<u64> {
        g.as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap())
            .collect()
    };
    hf_reference(model)["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect()
}

/// Every `generated ids: a,b,c` line of rank 0's output `text`.
pub fn generated_ids(text: &str) -> Vec<Vec<u64>> {
    text.lines()
        .filter_map(|l| l.split("generated ids: ").nth(1))
        .map(|ids| ids.split(',').map(|i| i.trim().parse().unwrap()).collect())
        .collect()
}

/// Saves fixture `name` with `--save-hf` from tensor-parallel shards (`--tp 2`) to `saved`,
/// checks that `eval` on one rank reads it back to the fixture's own result bit for bit, and
/// returns the saved `model.safetensors.index.json`.
pub fn save_hf_round_trip<T: PartialEq + std::fmt::Debug>(
    name: &str,
    saved: &Path,
    eval: impl Fn(usize, &Path, &[&str]) -> T,
) -> serde_json::Value {
    let fixture = hf_fixtures().join(name);
    eval(
        2,
        &fixture,
        &["--tp", "2", "--save-hf", saved.to_str().unwrap()],
    );
    let before = eval(1, &fixture, &[]);
    let after = eval(1, saved, &[]);
    eprintln!("{name}: {before:?} -> saved -> {after:?}");
    assert_eq!(before, after, "{name}");
    let index = std::fs::read_to_string(saved.join("model.safetensors.index.json")).unwrap();
    serde_json::from_str(&index).unwrap()
}

/// The number after `key` on the first line of `text` holding it.
pub fn number_after<T: std::str::FromStr>(text: &str, key: &str) -> T {
    text.lines()
        .find_map(|l| l.split(key).nth(1))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {key:?} in {text}"))
}
