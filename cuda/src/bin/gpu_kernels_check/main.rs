//! Checks every raw device kernel (fused attention through cuDNN and its NVRTC fallback,
//! cuBLASLt epilogues, fused LayerNorm, multi-tensor AdamW, fused classifier, vectorised
//! element-wise, conversions and fills) against f64 on CUDA device 0, then times them; prints a table.
//! Usage: `gpu_kernels_check [--no-timing] [--repeats N]`. Exits 0 when every check passes or
//! no CUDA device exists (it says it was skipped), 1 when a check fails, 2 on an error.

//!
//! Every kernel and dtype runs on random never-zero inputs against an f64 CPU reference
//! (`‖out − ref‖ / ‖ref‖` against the tolerance of its precision; outputs poisoned with NaN
//! first so an unwritten element fails), then timings with CUDA events (warm-up, median of
//! repeats, rotating inputs) as TFLOP/s or GB/s beside measured ceilings.

mod adamw;
mod attention;
mod casts;
mod classifier;
mod fused;
mod harness;
mod matmul;

use std::sync::Arc;

use harness::{time_ms, Buf, Check, Report, TimingRun};
use oxiflow_cuda::kernel_layer::cudnn_attention;
use oxiflow_cuda::{cuda_unavailable, device_error as derr, init_cuda, CudaRuntime};
use oxiflow_tensor::Result;

/// What to run.
#[derive(Clone, Debug, Default)]
pub struct CheckOptions {
    /// Skip the timings (correctness only).
    pub no_timing: bool,
    /// Repeats per timing (median reported).
    pub repeats: usize,
}

fn main() {
    let mut opts = CheckOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--no-timing" => opts.no_timing = true,
            "--repeats" => opts.repeats = args.next().and_then(|v| v.parse().ok()).unwrap_or(20),
            other => {
                eprintln!("unknown argument {other}; usage: gpu_kernels_check [--no-timing] [--repeats N]");
                std::process::exit(2);
            }
        }
    }
    match run_kernel_checks(&opts) {
        Ok(None) => println!("gpu_kernels_check skipped: no CUDA device"),
        Ok(Some(true)) => {}
        Ok(Some(false)) => std::process::exit(1),
        Err(e) => {
            eprintln!("gpu_kernels_check: {e}");
            std::process::exit(2);
        }
    }
}

/// Measured ceilings: device-to-device copy bandwidth (bytes read + written).
fn copy_ceiling(rt: &Arc<CudaRuntime>, repeats: usize) -> Result<f64> {
    let bytes = 1usize << 30;
    let (a, b) = (Buf::new(rt, bytes)?, Buf::new(rt, bytes)?);
    a.poison(rt)?;
    let ms = time_ms(rt, repeats, |_| {
        // SAFETY: both blocks hold `bytes` bytes; the copy is stream-ordered.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                b.ptr(),
                a.ptr(),
                bytes,
                rt.stream().cu_stream(),
            )
        }
        .map_err(|e| derr("copy ceiling", e))
    })?;
    Ok(2.0 * bytes as f64 / (ms * 1e-3) / 1e9)
}

/// Runs every check (and the timings unless `no_timing`) on CUDA device 0 and prints the
/// table. `Ok(None)` when no CUDA device is usable (the caller reports a skip).
fn run_kernel_checks(opts: &CheckOptions) -> Result<Option<bool>> {
    if let Some(why) = cuda_unavailable() {
        println!("skipped: {why}");
        return Ok(None);
    }
    let rt = init_cuda(0)?;
    let repeats = if opts.repeats == 0 { 20 } else { opts.repeats };
    let mut rep = Report::default();
    match cudnn_attention::cudnn_version("kernel check") {
        Ok(v) => rep.notes.push(format!("cuDNN version {v}")),
        Err(e) => rep.notes.push(format!("cuDNN: {e}")),
    }
    for n in &rep.notes {
        println!("note  {n}");
    }
    attention::checks(&rt, &mut rep)?;
    for n in cudnn_attention::cudnn_report() {
        println!("note  {n}");
    }
    matmul::checks(&rt, &mut rep)?;
    fused::checks(&rt, &mut rep)?;
    classifier::checks(&rt, &mut rep)?;
    casts::checks(&rt, &mut rep)?;
    if !opts.no_timing {
        let bw = copy_ceiling(&rt, repeats)?;
        let mm = matmul::ceiling(&rt, repeats)?;
        println!("ceiling copy {bw:.0} GB/s (read + write), bf16 matmul 8192^3 {mm:.0} TFLOP/s");
        let run = TimingRun { repeats, bw, mm };
        attention::timings(&rt, &mut rep, &run)?;
        matmul::timings(&rt, &mut rep, &run)?;
        fused::timings(&rt, &mut rep, &run)?;
        classifier::timings(&rt, &mut rep, &run)?;
        casts::timings(&rt, &mut rep, &run)?;
    }
    print_table(&rep);
    Ok(Some(rep.checks.iter().all(Check::pass)))
}

fn print_table(rep: &Report) {
    println!();
    println!("| check | dtype | shape | ‖out − ref‖/‖ref‖ | tol | result | note |");
    println!("|---|---|---|---|---|---|---|");
    for c in &rep.checks {
        let res = if c.pass() { "pass" } else { "FAIL" };
        println!(
            "| {} | {:.2e} | {:.0e} | {} | {} |",
            c.subject.cells(),
            c.err,
            c.tol,
            res,
            c.note
        );
    }
    if !rep.timings.is_empty() {
        println!();
        println!("| timing | dtype | shape | ms | rate | ceiling |");
        println!("|---|---|---|---|---|---|");
        for t in &rep.timings {
            println!(
                "| {} | {:.4} | {:.1} {} | {} |",
                t.subject.cells(),
                t.ms,
                t.rate,
                t.unit,
                t.ceiling
            );
        }
    }
    let failed = rep.checks.iter().filter(|c| !c.pass()).count();
    println!();
    println!("{} passed, {} failed", rep.checks.len() - failed, failed);
}
