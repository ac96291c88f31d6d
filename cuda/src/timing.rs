//! Opt-in per-op device timing for profiling: while on, every op the CUDA backend runs
//! synchronises the compute stream before and after its kernels and adds the elapsed wall time
//! to a table keyed by the op's name (launch cost included, host work between ops excluded).
//! Off by default; programs switch it on with `set_op_timing(true)` and read `op_timings`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::CudaRuntime;
use oxiflow_tensor::Result;

static ON: AtomicBool = AtomicBool::new(false);
static TABLE: Mutex<Option<HashMap<&'static str, (u64, f64)>>> = Mutex::new(None);

/// Switches per-op timing on or off (the table keeps its entries).
pub fn set_op_timing(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Empties the table.
pub fn reset_op_timings() {
    *TABLE.lock().unwrap_or_else(|p| p.into_inner()) = None;
}

/// `(op name, calls, seconds)` per op, the most expensive first.
pub fn op_timings() -> Vec<(&'static str, u64, f64)> {
    let g = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let mut v: Vec<_> = g
        .iter()
        .flat_map(|m| m.iter().map(|(k, (n, s))| (*k, *n, *s)))
        .collect();
    v.sort_by(|a, b| b.2.total_cmp(&a.2));
    v
}

/// Whether ops are timed one by one now.
pub(crate) fn timing_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Runs `f`, timed under `name` when timing is on.
pub(crate) fn timed<R>(
    rt: &CudaRuntime,
    name: &'static str,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    rt.synchronize()?;
    let t0 = Instant::now();
    let r = f()?;
    rt.synchronize()?;
    let dt = t0.elapsed().as_secs_f64();
    let mut g = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let e = g
        .get_or_insert_with(HashMap::new)
        .entry(name)
        .or_insert((0, 0.0));
    e.0 += 1;
    e.1 += dt;
    Ok(r)
}
