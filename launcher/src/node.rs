//! What this node offers: its GPU count (for `--nproc-per-node auto|gpu` and device binding)
//! and its CPU count.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Counts GPUs: the `/dev/nvidia<N>` device files, else the `GPU ` lines of `nvidia-smi -L`
/// (given at most 10 s), else 0.
pub fn count_gpus() -> usize {
    let devices = std::fs::read_dir("/dev")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter(|e| {
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    name.strip_prefix("nvidia").is_some_and(|rest| {
                        !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit())
                    })
                })
                .count()
        })
        .unwrap_or(0);
    if devices > 0 {
        return devices;
    }
    nvidia_smi_count(Duration::from_secs(10)).unwrap_or(0)
}

fn nvidia_smi_count(timeout: Duration) -> Option<usize> {
    let mut child = Command::new("nvidia-smi")
        .arg("-L")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => break,
            Ok(Some(_)) | Err(_) => return None,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                tracing::warn!("`nvidia-smi -L` did not answer within {timeout:?}");
                return None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let mut out = String::new();
    use std::io::Read;
    child.stdout.take()?.read_to_string(&mut out).ok()?;
    Some(out.lines().filter(|l| l.starts_with("GPU ")).count())
}

/// CPUs this process may use.
pub fn count_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Most workers one oflaunch starts, whatever the limits allow.
pub const MAX_WORKERS_PER_NODE: usize = 1024;
/// File descriptors oflaunch needs per worker: its stdout and stderr pipes and, with
/// --log-dir, its two log files.
const FDS_PER_WORKER: u64 = 4;
/// Descriptors kept for oflaunch itself (store, sockets, libraries).
const FDS_RESERVED: u64 = 64;
/// Processes and threads per worker counted by RLIMIT_NPROC: the worker and oflaunch's two
/// output threads for it, and room for the worker's own threads.
const TASKS_PER_WORKER: u64 = 8;

/// The most workers this node can run under its limits, and which limit sets that number.
pub fn max_workers() -> (usize, String) {
    let soft = |resource| {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into the struct we own.
        let rc = unsafe { libc::getrlimit(resource, &mut lim) };
        (rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
    };
    let mut best = (
        MAX_WORKERS_PER_NODE,
        format!("oflaunch's cap of {MAX_WORKERS_PER_NODE} workers per node"),
    );
    if let Some(files) = soft(libc::RLIMIT_NOFILE) {
        let n = files.saturating_sub(FDS_RESERVED) / FDS_PER_WORKER;
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if n < best.0 {
            best = (
                n,
                format!("the open-files limit (ulimit -n {files}; {FDS_PER_WORKER} per worker)"),
            );
        }
    }
    if let Some(tasks) = soft(libc::RLIMIT_NPROC) {
        let n = usize::try_from(tasks / TASKS_PER_WORKER).unwrap_or(usize::MAX);
        if n < best.0 {
            best = (
                n,
                format!("the process limit (ulimit -u {tasks}; {TASKS_PER_WORKER} per worker)"),
            );
        }
    }
    best
}
