//! The launcher's catalogue of bad situations, each on real processes with the message, the
//! exit code and a time bound asserted: ranks frozen by a debugger (one that never collects
//! their exit) or stopped end the job within about a second of being named.

mod common;
mod gdb;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// Wall-clock limit of a whole case (a bound on hangs, not the measure).
const T: Duration = Duration::from_secs(90);
/// The longest oflaunch may take from naming a frozen rank to exiting ("about a second"; a
/// margin for a loaded machine).
const NAMED_TO_EXIT: Duration = Duration::from_millis(2500);

/// Two paced ranks (light on the CPU) under oflaunch with `--stall-timeout 2`; returns the job
/// and the workers' pids by rank once both are all-reducing.
fn paced_job(dir: &std::path::Path) -> (Running, Vec<i32>) {
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args(["--nproc-per-node", "2", "--backend", "cpu"])
        .args(["--stall-timeout", "2", "--timeout", "60"])
        .args([WORKER, "pace", dir.to_str().unwrap(), "20"]);
    let job = start(cmd);
    wait_for_pids(dir, 2, T);
    for rank in 0..2 {
        job.wait_line(&format!("rank {rank} is pacing"), T);
    }
    let pid = |r: usize| -> i32 {
        let text = std::fs::read_to_string(dir.join(format!("pid_{r}"))).unwrap();
        text.trim().parse().unwrap()
    };
    (job, vec![pid(0), pid(1)])
}

/// Freezes `pid`'s main thread under ptrace (PTRACE_SEIZE, PTRACE_INTERRUPT) from a thread
/// that then never collects it, as a debugger waiting for its user does; the thread lets go
/// (and the kernel detaches) when `release` is dropped. Returns the tracer's thread id.
fn freeze_without_reaping(pid: i32) -> (std::sync::mpsc::Sender<()>, i32) {
    let (tx, rx) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let null = std::ptr::null_mut::<libc::c_void>();
        // SAFETY: PTRACE_SEIZE and PTRACE_INTERRUPT on a worker of this test; no memory is
        // passed (the address and data arguments are null).
        let seized = unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, null, null) } == 0
            // SAFETY: as above.
            && unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, pid, null, null) } == 0;
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let _ = tx.send(seized.then_some(tid));
        let _ = released.recv_timeout(T);
    });
    let tid = rx.recv().unwrap().expect("ptrace the worker");
    (release, tid)
}

fn assert_ended_by(r: &Finished, frozen_at: Instant, named: &str, bound: Duration) {
    let named_at = r
        .line_at(named)
        .unwrap_or_else(|| panic!("never named ({named:?}):\n{}", r.stderr));
    let to_exit = r.ended.duration_since(named_at);
    let total = r.ended.duration_since(frozen_at);
    eprintln!(
        "named {:?} after the freeze; exited {to_exit:?} after naming",
        named_at - frozen_at
    );
    assert!(
        to_exit <= NAMED_TO_EXIT,
        "{to_exit:?} from naming to exit\n{}",
        r.stderr
    );
    assert!(
        total <= bound,
        "{total:?} from the freeze to exit\n{}",
        r.stderr
    );
}

/// A rank frozen by a tracer that never collects its exit (gdb at its prompt): named, killed
/// at once, and not waited for.
#[test]
fn a_rank_held_by_a_tracer_ends_the_job_within_a_second_of_naming_it() {
    let dir = scratch("held");
    let (job, pids) = paced_job(&dir);
    let frozen_at = Instant::now();
    let (release, tracer) = freeze_without_reaping(pids[1]);
    let r = job.finish(T);
    drop(release);
    assert_eq!(r.code(), 124, "{}", r.stderr);
    let named =
        format!("rank 1 is frozen: its main thread is in a ptrace stop (traced by pid {tracer})");
    assert_ended_by(&r, frozen_at, &named, Duration::from_secs(2 + 6));
    assert!(
        r.stderr.contains(&format!(
            "rank 1 (pid {}) is dead; its tracer (pid {tracer}) holds its exit status",
            pids[1]
        )),
        "{}",
        r.stderr
    );
    says(&r, "first failure: rank 1 (node 0");
    never_says(&r, "after SIGTERM; sending SIGKILL");
    assert_gone(pids);
}

/// The same under a real gdb in batch mode, busy with a shell command (so it does not collect
/// the killed rank either), when gdb is installed.
#[test]
fn a_rank_under_gdb_ends_the_job_within_a_second_of_naming_it() {
    if !gdb::have_gdb("a_rank_under_gdb") {
        return;
    }
    let dir = scratch("gdb");
    let (job, pids) = paced_job(&dir);
    let frozen_at = Instant::now();
    let mut gdb = gdb::attach(pids[1], 40);
    let r = job.finish(T);
    let _ = gdb.kill();
    let _ = gdb.wait();
    assert_eq!(r.code(), 124, "{}", r.stderr);
    // gdb stops every thread (the heartbeat too) or is seen in its ptrace stop first.
    assert_ended_by(
        &r,
        frozen_at,
        "rank 1 is frozen: ",
        Duration::from_secs(2 + 15),
    );
    says(&r, "first failure: rank 1 (node 0");
    never_says(&r, "after SIGTERM; sending SIGKILL");
    never_says(&r, "not reaped");
}

/// A rank stopped with SIGSTOP: named within seconds, killed without a grace period.
#[test]
fn a_stopped_rank_ends_the_job_within_a_second_of_naming_it() {
    let dir = scratch("stopped");
    let (job, pids) = paced_job(&dir);
    let frozen_at = Instant::now();
    signal(&pids[1..], libc::SIGSTOP);
    let r = job.finish(T);
    // Named frozen (the stall timeout is 2 s) or stopped for too long (3 s), whichever first.
    let named = if r.stderr.contains("rank 1 is frozen: ") {
        assert_eq!(r.code(), 124, "{}", r.stderr);
        "rank 1 is frozen: "
    } else {
        assert_eq!(r.code(), 128 + libc::SIGSTOP, "{}", r.stderr);
        "stopped by SIGSTOP"
    };
    assert_ended_by(&r, frozen_at, named, Duration::from_secs(3 + 5));
    says(&r, "first failure: rank 1 (node 0");
    assert_gone(pids);
}

/// The flags of node `node_rank` of a two-node job with its store at `port` and a 12 s limit.
fn two_node_flags<'a>(node_rank: &'a str, port: &'a str) -> [&'a str; 8] {
    [
        "--nnodes",
        "2",
        "--node-rank",
        node_rank,
        "--master-port",
        port,
        "--timeout",
        "12",
    ]
}

/// Runs `run` and asserts it exited with `code` having said a notice of a long wait: read
/// between 10 s (less a little for the clocks) and 10 s plus a margin for load after the
/// start, and the process ended when its limit (12 s) came. The finished run.
fn run_saying_at_10_s(code: i32, notice: &str, run: impl FnOnce() -> Finished) -> Finished {
    let started = Instant::now();
    let r = run();
    assert_eq!(r.code(), code, "{}", r.stderr);
    let at = r
        .line_at(notice)
        .unwrap_or_else(|| panic!("no notice {notice:?}:\n{}", r.stderr))
        .duration_since(started);
    eprintln!(
        "said {notice:?} after {at:?}; ended after {:?}",
        r.ended - started
    );
    assert!(
        at >= Duration::from_millis(9_500) && at <= Duration::from_millis(12_500),
        "{at:?}\n{}",
        r.stderr
    );
    let ended = r.ended.duration_since(started);
    assert!(
        ended >= Duration::from_millis(11_500) && ended <= Duration::from_secs(20),
        "{ended:?}\n{}",
        r.stderr
    );
    let notices = r.stderr.lines().filter(|l| l.contains(notice)).count();
    assert_eq!(notices, 1, "one notice in 12 s:\n{}", r.stderr);
    r
}

/// A test worker started by hand as `rank` of `world` with a 12 s `OXIFLOW_TIMEOUT`.
fn rank_by_hand(rank: usize, world: usize, port: u16, args: &[&str]) -> Finished {
    let mut cmd = Command::new(WORKER);
    cmd.args(args).env_clear();
    for (k, v) in [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("OXIFLOW_TOKEN", "catalogue-token".into()),
        ("OXIFLOW_TIMEOUT", "12".into()),
        ("OXIFLOW_BACKEND", "cpu".into()),
    ] {
        cmd.env(k, v);
    }
    start(cmd).finish(T)
}

#[test]
fn a_rank_without_a_store_says_what_it_waits_for_every_10_s() {
    let port = free_port();
    let r = run_saying_at_10_s(
        3,
        &format!("rank 1 of 2: waiting for the rendezvous store at 127.0.0.1:{port}, which does not answer (transport error: tcp connect error: Connection refused"),
        || rank_by_hand(1, 2, port, &["allreduce", "1"]),
    );
    says(&r, "of at most 12 s (OXIFLOW_TIMEOUT)");
    says(
        &r,
        &format!("no rendezvous store answered at 127.0.0.1:{port} within 12s"),
    );
}

#[test]
fn a_rank_waiting_for_the_others_to_join_says_so_every_10_s() {
    let port = free_port();
    let r = run_saying_at_10_s(
        3,
        "waiting for rank(s) [1, 2] of 3 to join the job at the store",
        || rank_by_hand(0, 3, port, &["allreduce", "1"]),
    );
    says(
        &r,
        "ranks never arrived: timed out after 12s waiting for rank(s) [1, 2]",
    );
}

#[test]
fn node_0_waiting_for_a_missing_node_says_so_every_10_s() {
    let dir = scratch("missing_node");
    let port = free_port().to_string();
    let args = two_node_flags("0", &port);
    let r = run_saying_at_10_s(
        2,
        &format!("oflaunch on node 0: waiting for node(s) [1] of 2 to join at 127.0.0.1:{port}"),
        || {
            let worker = [WORKER, "env", dir.to_str().unwrap()];
            oflaunch(&args.into_iter().chain(worker).collect::<Vec<_>>(), T)
        },
    );
    says(&r, "of at most 12 s (--timeout)");
    says(&r, "timed out after 12s waiting for node(s) [1] to join");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a worker ran");
}

#[test]
fn a_node_waiting_for_node_0_says_so_every_10_s() {
    let dir = scratch("missing_node_0");
    let port = free_port().to_string();
    let args = two_node_flags("1", &port);
    let r = run_saying_at_10_s(
        2,
        &format!("oflaunch on node 1: waiting for the rendezvous store at 127.0.0.1:{port}, which does not answer"),
        || {
            let mut cmd = Command::new(OFLAUNCH);
            cmd.args(args)
                .args([WORKER, "env", dir.to_str().unwrap()])
                .env("OXIFLOW_TOKEN", "catalogue-token");
            start(cmd).finish(T)
        },
    );
    says(&r, "cannot reach the store at");
}

#[test]
fn oflaunch_waiting_for_workers_to_exit_says_which_every_10_s() {
    let script = "if [ \"$RANK\" = 0 ]; then sleep 0.5; exit 1; fi; \
                  trap '' TERM; while :; do sleep 1; done";
    let started = Instant::now();
    let r = oflaunch(
        &[
            "--nproc-per-node",
            "2",
            "--grace-period",
            "12",
            "sh",
            "-c",
            script,
        ],
        T,
    );
    assert_eq!(r.code(), 1, "{}", r.stderr);
    // Counted from the SIGTERM, half a second after the start.
    let notice = "oflaunch: waiting for rank(s) 1 (pid ";
    let at = r.line_at(notice).unwrap_or_else(|| panic!("{}", r.stderr)) - started;
    assert!(
        at >= Duration::from_secs(10) && at <= Duration::from_secs(13),
        "{at:?}\n{}",
        r.stderr
    );
    says(
        &r,
        ") to exit after SIGTERM; waited 10 s of at most 22 s (--grace-period",
    );
    says(&r, "still running 12s after SIGTERM; sending SIGKILL");
    ended_within(&r, started, Duration::from_secs(16));
}

/// A rank behind in a collective is named when the others have waited 3 s, then again every
/// 10 s while they wait.
#[test]
fn a_rank_behind_is_named_again_every_10_s() {
    let started = Instant::now();
    let r = oflaunch(
        &argv("--nproc-per-node 2 --backend cpu --timeout 40")
            .into_iter()
            .chain([WORKER, "allreduce", "3", "1", "1", "15"])
            .collect::<Vec<_>>(),
        T,
    );
    assert_eq!(r.code(), 0, "{}", r.stderr);
    let named: Vec<Instant> = r
        .lines
        .iter()
        .filter(|(_, l)| l.starts_with("oflaunch: rank 1 is behind: "))
        .map(|(t, _)| *t)
        .collect();
    eprintln!(
        "named at {:?}",
        named.iter().map(|t| *t - started).collect::<Vec<_>>()
    );
    assert_eq!(named.len(), 2, "{}", r.stderr);
    let gap = named[1] - named[0];
    assert!(
        gap >= Duration::from_millis(9_500) && gap <= Duration::from_millis(13_000),
        "{gap:?}\n{}",
        r.stderr
    );
}

/// Every rank hits the same error, at slightly different moments, and writes it in pieces (as
/// `eprintln!` does): one line on the console with the ranks' list, the summary naming the
/// first and the ranks that ended alike without repeating the line, and nothing cut short.
#[test]
fn an_error_every_rank_hit_alike_is_printed_once_with_the_ranks() {
    let script = "sleep 0.$RANK; printf 'train: ' >&2; sleep 0.1; \
                  echo '--data missing.txt: cannot open: No such file or directory' >&2; exit 2";
    let started = Instant::now();
    let r = oflaunch(&["--nproc-per-node", "4", "sh", "-c", script], T);
    assert_eq!(r.code(), 2, "{}", r.stderr);
    let error = "train: --data missing.txt: cannot open: No such file or directory";
    let copies: Vec<&str> = r.stderr.lines().filter(|l| l.contains(error)).collect();
    assert_eq!(copies, [format!("[ranks 0-3] {error}")], "{}", r.stderr);
    says(&r, "first failure: rank 0 (node 0, host ");
    says(&r, "  ranks 0-3 ended alike (exit code 2)\n");
    for noise in ["no heartbeat", "| train", "state of the ranks"] {
        never_says(&r, noise);
    }
    for line in r.stderr.lines() {
        assert!(
            !line.trim_end().ends_with("train:"),
            "cut short: {line:?}\n{}",
            r.stderr
        );
    }
    ended_within(&r, started, Duration::from_secs(5));
}

/// One rank fails while the others run on: its line is printed once as `[rank 2] ...`, the
/// others are stopped after the short window for ending alike, and the summary does not repeat
/// the line.
#[test]
fn one_ranks_error_is_printed_once_and_the_others_are_stopped() {
    let script =
        "if [ \"$RANK\" = 2 ]; then sleep 0.3; echo 'step 7: loss is NaN' >&2; exit 3; fi; \
                  sleep 60";
    let r = oflaunch(&["--nproc-per-node", "4", "sh", "-c", script], T);
    assert_eq!(r.code(), 3, "{}", r.stderr);
    let copies: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| l.contains("loss is NaN"))
        .collect();
    assert_eq!(copies, ["[rank 2] step 7: loss is NaN"], "{}", r.stderr);
    says(&r, "first failure: rank 2 (node 0");
    never_says(&r, "ended alike");
    let failed = r
        .line_at("worker failed (exit code 3)")
        .expect("the failure logged");
    let took = r.ended - failed;
    assert!(took < Duration::from_millis(2500), "{took:?}\n{}", r.stderr);
}

/// The console hides rank 2 (`--ranks-filter 0`): its lines are not shown, so the summary
/// carries them.
#[test]
fn a_failed_ranks_lines_the_console_did_not_show_are_in_the_summary() {
    let script = "if [ \"$RANK\" = 1 ]; then echo 'bad shard' >&2; exit 5; fi; sleep 60";
    let r = oflaunch(
        &[
            "--nproc-per-node",
            "2",
            "--ranks-filter",
            "0",
            "sh",
            "-c",
            script,
        ],
        T,
    );
    assert_eq!(r.code(), 5, "{}", r.stderr);
    never_says(&r, "[rank 1] bad shard");
    says(&r, "    | bad shard\n");
}

/// A mistyped program: each folder looked in is named once (oflaunch's own folder is also on
/// PATH here, spelled another way), and the program built beside oflaunch with a close name is
/// suggested.
#[test]
fn a_mistyped_program_names_each_folder_once_and_the_close_name() {
    let own = std::path::Path::new(OFLAUNCH).parent().unwrap();
    let path = std::env::join_paths([own.join("."), own.to_path_buf(), "/usr/bin".into()]).unwrap();
    let mut cmd = Command::new(OFLAUNCH);
    cmd.arg("oflaunch_testwroker").env("PATH", path);
    let started = Instant::now();
    let r = start(cmd).finish(T);
    assert_eq!(r.code(), 2, "{}", r.stderr);
    let want = format!(
        "oflaunch: error: cannot find program \"oflaunch_testwroker\"; looked in: {}, {}, \
         /usr/bin; did you mean oflaunch_testworker?\n",
        own.display(),
        own.join("examples").display()
    );
    assert_eq!(r.stderr, want);
    ended_within(&r, started, Duration::from_secs(5));
}

/// oflaunch's environment is checked like its flags, before anything starts: each bad value is
/// refused with exit code 2 and one line naming the variable and its value; no worker runs.
#[test]
fn bad_environment_variables_are_refused_before_anything_starts() {
    let cases: &[(&str, &str, &str)] = &[
        ("OXIFLOW_TOKEN", "", "OXIFLOW_TOKEN is set but empty"),
        ("OXIFLOW_TOKEN", "has space", "OXIFLOW_TOKEN: "),
        (
            "OXIFLOW_FLIGHT_DIR",
            "/proc",
            "OXIFLOW_FLIGHT_DIR=\"/proc\" cannot hold the flight dumps: /proc is on procfs, a \
             kernel file system that cannot hold files",
        ),
        (
            "OXIFLOW_FLIGHT_DIR",
            "/sys/kernel/x",
            "OXIFLOW_FLIGHT_DIR=\"/sys/kernel/x\" cannot hold the flight dumps: /sys/kernel is on sysfs",
        ),
        (
            "OXIFLOW_TRACE_DIR",
            "/proc/self",
            "OXIFLOW_TRACE_DIR=\"/proc/self\" cannot hold this rank's files: /proc/self is on procfs",
        ),
        ("OXIFLOW_TRACE_DIR", "", "OXIFLOW_TRACE_DIR=\"\" is set but names no folder"),
        (
            "OXIFLOW_KERNEL_CACHE",
            "/sys/kernel/cache",
            "OXIFLOW_KERNEL_CACHE=\"/sys/kernel/cache\" cannot hold this rank's files: /sys/kernel is on sysfs",
        ),
        (
            "OXIFLOW_RESTART_COUNT",
            "abc",
            "OXIFLOW_RESTART_COUNT=\"abc\" is not a restart count",
        ),
        ("OXIFLOW_RESTART_COUNT", "-1", "OXIFLOW_RESTART_COUNT=\"-1\" is not a restart count"),
        ("OXIFLOW_TIMEOUT", "soon", "OXIFLOW_TIMEOUT=\"soon\" is not a positive number of seconds"),
        ("OXIFLOW_BACKEND", "gpu", "OXIFLOW_BACKEND=\"gpu\" is not one of auto, nccl, cpu, mpi"),
        ("OXIFLOW_SHM", "maybe", "OXIFLOW_SHM=\"maybe\" is not one of 0, 1, true, false, on, off"),
        ("OXIFLOW_CUDA_GRAPH", "yes", "OXIFLOW_CUDA_GRAPH=\"yes\" is not 0 or 1"),
        ("OXIFLOW_NCCL_MEMORY", "2", "OXIFLOW_NCCL_MEMORY=\"2\" is not 0 or 1"),
        (
            "OXIFLOW_CUDA_LIB_DIRS",
            "/no/such/lib",
            "OXIFLOW_CUDA_LIB_DIRS=\"/no/such/lib\": /no/such/lib is not a folder",
        ),
        ("OXIFLOW_STORE_PREFIX", "a b/", "OXIFLOW_STORE_PREFIX=\"a b/\" is not a key prefix"),
        (
            "OXIFLOW_TIMOUT",
            "30",
            "OXIFLOW_TIMOUT is not a variable OxiFlow reads; did you mean OXIFLOW_TIMEOUT?",
        ),
        ("OFLAUNCH_LOG", "[[", "OFLAUNCH_LOG=\"[[\" is not a log filter"),
    ];
    for (var, value, want) in cases {
        let dir = scratch("bad_env");
        let mut cmd = Command::new(OFLAUNCH);
        cmd.args([
            "--nproc-per-node",
            "2",
            WORKER,
            "env",
            dir.to_str().unwrap(),
        ])
        .env(var, value);
        let started = Instant::now();
        let r = start(cmd).finish(T);
        let what = format!("{var}={value:?}");
        assert_eq!(r.code(), 2, "{what}:\n{}", r.stderr);
        assert!(
            r.stderr.contains(want),
            "{what}: want {want:?} in\n{}",
            r.stderr
        );
        assert_eq!(
            r.stderr.lines().count(),
            1,
            "{what}: one line\n{}",
            r.stderr
        );
        assert!(
            r.stderr.starts_with("oflaunch: error: "),
            "{what}:\n{}",
            r.stderr
        );
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "{what}: a worker ran"
        );
        assert!(r.ended - started < Duration::from_secs(5), "{what}: slow");
    }
    // Flags naming folders are checked the same way.
    for (flag, value) in [("--trace", "/proc/traces"), ("--log-dir", "/sys/logs")] {
        let r = oflaunch(&[flag, value, "true"], T);
        assert_eq!(r.code(), 2, "{flag}:\n{}", r.stderr);
        assert!(
            r.stderr.contains(&format!("{flag} {value}: /"))
                && r.stderr.contains("a kernel file system"),
            "{flag}:\n{}",
            r.stderr
        );
    }
}

/// A worker started by hand reads the same checks: garbage in a variable is one error naming it
/// and its value, before the rank meets anyone.
#[test]
fn a_rank_refuses_bad_environment_variables() {
    for (var, value, want) in [
        (
            "OXIFLOW_RESTART_COUNT",
            "abc",
            "OXIFLOW_RESTART_COUNT=\"abc\" is not a restart count",
        ),
        (
            "OXIFLOW_TOKEN",
            "",
            "OXIFLOW_TOKEN is unusable: the token is empty",
        ),
        (
            "OXIFLOW_FLIGHT_DIR",
            " ",
            "OXIFLOW_FLIGHT_DIR=\" \" is set but names no folder",
        ),
        (
            "OXIFLOW_NNODES",
            "3",
            "OXIFLOW_NNODES=\"3\" is not a node count in 1..=2",
        ),
        ("OXIFLOW_BACKNED", "cpu", "did you mean OXIFLOW_BACKEND?"),
    ] {
        let mut cmd = Command::new(WORKER);
        cmd.args(["allreduce", "1"]).env_clear();
        for (k, v) in [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
            ("OXIFLOW_TOKEN", "catalogue"),
            ("OXIFLOW_TIMEOUT", "5"),
            ("OXIFLOW_BACKEND", "cpu"),
        ] {
            cmd.env(k, v);
        }
        cmd.env(var, value);
        let r = start(cmd).finish(T);
        assert_eq!(r.code(), 3, "{var}:\n{}", r.stderr);
        assert!(
            r.stderr.contains(want),
            "{var}: want {want:?} in\n{}",
            r.stderr
        );
        assert_eq!(r.stderr.lines().count(), 1, "{var}:\n{}", r.stderr);
    }
}
