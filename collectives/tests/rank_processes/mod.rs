//! What the GPU suites that re-run their binary once per rank share: waiting for the rank
//! processes with a time limit and reporting their exit codes, and the number of cases a rank
//! runs.

use std::process::Child;
use std::time::{Duration, Instant};

/// The exit codes of `kids` once all have ended; those still running after `limit` are
/// killed (their code is then None, or the one they ended with meanwhile).
fn wait_all(mut kids: Vec<Child>, limit: Duration) -> Vec<Option<i32>> {
    let t = Instant::now();
    let mut codes = vec![None; kids.len()];
    let mut done = vec![false; kids.len()];
    while done.iter().any(|d| !d) {
        for (i, k) in kids.iter_mut().enumerate() {
            if !done[i] {
                if let Ok(Some(s)) = k.try_wait() {
                    codes[i] = s.code();
                    done[i] = true;
                }
            }
        }
        if t.elapsed() > limit {
            for (i, k) in kids.iter_mut().enumerate() {
                if !done[i] {
                    let _ = k.kill();
                    let _ = k.wait();
                    done[i] = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    codes
}

/// Starts the ranks (`spawn`), waits for them (see [`wait_all`]) and prints `{what}: exit
/// codes ... in ...` (the time from the start); the codes when a rank did not exit with 0.
pub fn ranks_failed(
    what: &str,
    spawn: impl FnOnce() -> Vec<Child>,
    limit: Duration,
) -> Option<Vec<Option<i32>>> {
    let t = Instant::now();
    let codes = wait_all(spawn(), limit);
    println!("{what}: exit codes {codes:?} in {:.1?}", t.elapsed());
    codes.iter().any(|c| *c != Some(0)).then_some(codes)
}

/// How many generated cases each rank runs: `OXIFLOW_GPU_CASES`, else `default`.
pub fn gpu_cases(default: u32) -> u32 {
    std::env::var("OXIFLOW_GPU_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}
