//! Checks every raw device kernel (fused attention through cuDNN and its NVRTC fallback,
//! cuBLASLt epilogues, fused LayerNorm, multi-tensor AdamW, fused classifier, vectorised
//! element-wise) against f64 on CUDA device 0, then times them; prints a table.
//! Usage: `gpu_kernels_check [--no-timing] [--repeats N]`. Exits 0 when every check passes or
//! no CUDA device exists (it says it was skipped), 1 when a check fails, 2 on an error.

use oxiflow_tensor::cuda::{run_kernel_checks, CheckOptions};

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
