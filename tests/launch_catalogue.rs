//! The launcher's catalogue with the real trainer: a `train` rank frozen under gdb ends the job
//! within a second of being named, an input error every rank hits is printed once with the
//! ranks' list, and bad launch-environment variables are refused before step 1 with one line
//! naming the variable and its value, nothing written. (`launcher/tests/launch_catalogue.rs`
//! holds the same classes and more with the launcher's test worker.)

mod common;
#[path = "../launcher/tests/gdb/mod.rs"]
mod gdb;

use common::argv;

use std::io::BufRead;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Wall-clock limit of a whole case (a bound on hangs, not the measure).
const T: Duration = Duration::from_secs(120);

/// A process whose stdout and stderr lines are kept with the instant each was read.
struct Watched {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Watched {
    fn start(mut cmd: Command) -> Watched {
        let mut child = common::spawn_piped(&mut cmd).expect("start");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().unwrap());
        let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().unwrap());
        let readers = [out, err]
            .into_iter()
            .map(|pipe| {
                let sink = lines.clone();
                std::thread::spawn(move || {
                    for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                        sink.lock().unwrap().push((Instant::now(), line));
                    }
                })
            })
            .collect();
        Watched {
            child,
            lines,
            readers,
        }
    }

    fn text(&self) -> String {
        let lines = self.lines.lock().unwrap();
        lines.iter().map(|(_, l)| format!("{l}\n")).collect()
    }

    /// When the first line containing `text` was read (waits up to `T`).
    fn wait_line(&self, text: &str) -> Instant {
        let t0 = Instant::now();
        loop {
            if let Some((at, _)) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(_, l)| l.contains(text))
            {
                return *at;
            }
            assert!(t0.elapsed() < T, "no line {text:?}:\n{}", self.text());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for the end: (exit code, when it ended, all lines).
    fn finish(mut self) -> (i32, Instant, String) {
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if t0.elapsed() > T {
                let _ = self.child.kill();
                panic!("still running after {T:?}:\n{}", self.text());
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let ended = Instant::now();
        for r in self.readers.drain(..) {
            r.join().unwrap();
        }
        (status.code().unwrap_or(-1), ended, self.text())
    }
}

fn oflaunch_train(nproc: usize, args: &[&str]) -> Command {
    let (oflaunch, train) = common::binaries();
    let mut cmd = Command::new(oflaunch);
    cmd.args(["--nproc-per-node", &nproc.to_string(), "--backend", "cpu"])
        .arg(train)
        .args(args);
    cmd
}

/// gdb attached to a training rank and waiting (busy with a shell command, as at its prompt):
/// the rank is named frozen, killed at once, and oflaunch exits within a second of naming it,
/// not after a grace period and a reap timeout.
#[test]
fn a_train_rank_under_gdb_ends_the_job_within_a_second_of_naming_it() {
    if !gdb::have_gdb("a_train_rank_under_gdb") {
        return;
    }
    let job = Watched::start(oflaunch_train(
        3,
        &argv("--model mlp --steps 100000000 --log-every 100"),
    ));
    job.wait_line("step 200 loss");
    let victim = common::workers_of(job.child.id(), 3)[1].1;
    let frozen_at = Instant::now();
    let mut gdb = gdb::attach(victim, 60);
    let named_at = job.wait_line("rank 1 is frozen: ");
    let (code, ended, text) = job.finish();
    let _ = gdb.kill();
    let _ = gdb.wait();
    eprintln!(
        "named {:?} after the freeze; exited {:?} after naming",
        named_at - frozen_at,
        ended - named_at
    );
    assert_eq!(code, 124, "{text}");
    assert!(ended - named_at < Duration::from_millis(2500), "{text}");
    assert!(ended - frozen_at < Duration::from_secs(20), "{text}");
    assert!(text.contains("first failure: rank 1 (node 0"), "{text}");
    for needless in ["after SIGTERM; sending SIGKILL", "not reaped"] {
        assert!(!text.contains(needless), "{needless:?}:\n{text}");
    }
    for line in text.lines() {
        assert!(
            !line.trim_end().ends_with("train:"),
            "cut short: {line:?}\n{text}"
        );
    }
}

/// Every rank refuses the same missing data file: one line with the ranks' list, the summary
/// naming the first and the ranks that ended alike, without repeating the line.
#[test]
fn an_input_error_every_train_rank_hits_is_printed_once() {
    let missing =
        std::env::temp_dir().join(format!("oxiflow_no_such_corpus_{}", std::process::id()));
    let missing = missing.to_str().unwrap();
    let job = oflaunch_train(4, &["--data", missing]);
    let started = Instant::now();
    let (code, ended, text) = Watched::start(job).finish();
    assert_ne!(code, 0, "{text}");
    let copies: Vec<&str> = text.lines().filter(|l| l.contains(missing)).collect();
    assert_eq!(copies.len(), 1, "{text}");
    assert!(copies[0].starts_with("[ranks 0-3] train: "), "{text}");
    assert!(
        text.contains("  ranks 0-3 ended alike (exit code "),
        "{text}"
    );
    for noise in ["no heartbeat", "    | train"] {
        assert!(!text.contains(noise), "{noise:?}:\n{text}");
    }
    assert!(ended - started < Duration::from_secs(30), "{text}");
}

/// `train` started alone with a bad launch variable: refused before step 1 with one line naming
/// the variable and its value; its metrics file is never created.
#[test]
fn train_refuses_bad_launch_variables_before_step_1() {
    let (_, train) = common::binaries();
    let dir = std::env::temp_dir().join(format!("oxiflow_launch_env_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("metrics.json");
    for (var, value, want) in [
        ("OXIFLOW_RESTART_COUNT", "abc", "OXIFLOW_RESTART_COUNT=\"abc\" is not a restart count"),
        ("OXIFLOW_TRACE_DIR", "/proc", "OXIFLOW_TRACE_DIR=\"/proc\" cannot hold this rank's files: /proc is on procfs"),
        ("OXIFLOW_TRACE_DIR", "/proc/traces", "OXIFLOW_TRACE_DIR=\"/proc/traces\" cannot hold this rank's files: /proc is on procfs"),
        ("OXIFLOW_FLIGHT_DIR", "/sys/kernel", "OXIFLOW_FLIGHT_DIR=\"/sys/kernel\" cannot hold this rank's files: /sys/kernel is on sysfs"),
        ("OXIFLOW_TOKEN", "", "OXIFLOW_TOKEN is unusable: the token is empty"),
        ("OXIFLOW_CUDA_GRAPH", "maybe", "OXIFLOW_CUDA_GRAPH=\"maybe\" is not 0 or 1"),
        ("OXIFLOW_TIMOUT", "5", "OXIFLOW_TIMOUT is not a variable OxiFlow reads; did you mean OXIFLOW_TIMEOUT?"),
    ] {
        let started = Instant::now();
        let out = Command::new(train)
            .args(["--model", "mlp", "--steps", "3", "--metrics"])
            .arg(&metrics)
            .env(var, value)
            .output()
            .unwrap();
        let took = started.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let what = format!("{var}={value:?}");
        assert!(!out.status.success(), "{what}: accepted\n{stdout}{stderr}");
        assert!(stderr.contains(want), "{what}: want {want:?} in\n{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{what}: one line\n{stderr}");
        assert!(!stdout.contains("step ") && !stdout.contains("final loss"), "{what}: trained\n{stdout}");
        assert!(!metrics.exists(), "{what}: {} written", metrics.display());
        assert!(took < Duration::from_secs(10), "{what}: {took:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
