//! Dispatch overhead benchmark: a cached global element-wise add of two tiny tensors on a 1-d
//! placement (1 rank, and 2 in-process ranks), whole per-op time (median over batches), printed
//! next to the same add on plain local tensors.
//!
//! `cargo run --release -p oxiflow-tensor --bin dispatch_bench [-- --iters N --shape 4x4]`

use std::time::{Duration, Instant};

use oxiflow_tensor::{run_ranks, DType, DeviceType, Placement, Sbp, Tensor};

const BATCHES: usize = 41;

/// Median per-op time in ns of `op`, run in `BATCHES` batches of `iters`.
fn median_ns(iters: usize, mut op: impl FnMut()) -> f64 {
    for _ in 0..iters {
        op();
    }
    let mut per_op: Vec<f64> = (0..BATCHES)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                op();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    per_op.sort_by(|a, b| a.total_cmp(b));
    per_op[BATCHES / 2]
}

fn parse_args() -> (usize, Vec<usize>) {
    let args: Vec<String> = std::env::args().collect();
    let mut iters = 20_000;
    let mut shape = vec![4, 4];
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--iters" => {
                iters = args
                    .get(i + 1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(iters);
                i += 1;
            }
            "--shape" => {
                if let Some(s) = args.get(i + 1) {
                    let parsed: Option<Vec<usize>> = s.split('x').map(|d| d.parse().ok()).collect();
                    shape = parsed.unwrap_or(shape);
                }
                i += 1;
            }
            _ => {}
        }
        i += 1;
    }
    (iters, shape)
}

fn global_add_ns(ranks: usize, iters: usize, shape: &[usize]) -> f64 {
    let p = match Placement::range(DeviceType::Cpu, ranks) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("placement: {e}");
            return f64::NAN;
        }
    };
    let times = run_ranks(ranks, Duration::from_secs(60), |_| {
        let make = |seed| Tensor::randn_global(shape.to_vec(), seed, DType::F32, &p, Sbp::S(0));
        let (a, b) = match (make(1), make(2)) {
            (Ok(a), Ok(b)) => (a, b),
            _ => return f64::NAN,
        };
        let mut ok = true;
        let t = median_ns(iters, || ok &= a.add(&b).is_ok());
        if ok {
            t
        } else {
            f64::NAN
        }
    });
    times[0]
}

fn main() {
    let (iters, shape) = parse_args();
    let a = Tensor::randn(shape.clone(), 1, DType::F32);
    let b = Tensor::randn(shape.clone(), 2, DType::F32);
    let local = median_ns(iters, || {
        let _ = a.add(&b);
    });
    let (av, bv) = match (a.to_ndarray::<f32>(), b.to_ndarray::<f32>()) {
        (Ok(x), Ok(y)) => (x, y),
        _ => return,
    };
    let raw = median_ns(iters, || {
        let _ = std::hint::black_box(&av + &bv);
    });
    let g1 = global_add_ns(1, iters, &shape);
    let g2 = global_add_ns(2, iters, &shape);
    println!("dispatch overhead, add of two f32 tensors of shape {shape:?}, median of {BATCHES} batches x {iters} ops");
    println!("  raw ndarray &a + &b            {:8.3} us/op", raw / 1e3);
    println!("  local Tensor::add              {:8.3} us/op", local / 1e3);
    println!("  global add, 1 rank  (S(0))     {:8.3} us/op", g1 / 1e3);
    println!("  global add, 2 ranks (S(0))     {:8.3} us/op  (in-process ranks, cached signature, no boxing)", g2 / 1e3);
}
