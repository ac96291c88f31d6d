//! The fused attention op (`oxiflow_ops::attention::flash_attention`) alone on CUDA device 0, through dispatch
//! and autograd as a model runs it: q, k, v `[B, T, H, D]` (three Linear outputs' layout),
//! forward and forward+backward TFLOP/s (medians of host-timed, device-synchronised runs after
//! warm-up, two input sets alternating; forward+backward counted as 3.5x the forward's
//! `4 B H T^2 D` (halved when causal), as `scripts/gpu/attention_anchor.py` counts torch's SDPA),
//! the peak device memory of a forward+backward, and ‖out − ref‖/‖ref‖ of o, lse, dq, dk, dv
//! against the f64 CPU kernel on a small shape and on batch entry 0 of the timed one. Prints
//! gpu_kernels_check's table rows.
//! Usage: `attention_bench [--batch 16] [--heads 12] [--seq 1024] [--dim 64] [--dtype bf16]
//! [--causal true] [--reps 20]`. Exits 0 when it ran and every error is within the dtype's
//! tolerance, or when there is no CUDA device (it says it was skipped); 1 when an error is over
//! tolerance; 2 on a failure.

use std::sync::Arc;
use std::time::Instant;

use oxiflow_cuda::{self as cuda, CudaStorage};
use oxiflow_ops::attention::{flash_attention, flash_attention_lse};
use oxiflow_tensor::{memory, no_grad, DType, Storage, Tensor};

type R<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    h: usize,
    t: usize,
    d: usize,
    causal: bool,
}

impl Shape {
    fn label(&self) -> String {
        let c = if self.causal { " causal" } else { "" };
        format!("B{} H{} T{} D{}{c}", self.b, self.h, self.t, self.d)
    }
    fn dims(&self) -> [usize; 4] {
        [self.b, self.t, self.h, self.d]
    }
    fn forward_flops(&self) -> f64 {
        let (b, h, t, d) = (self.b as f64, self.h as f64, self.t as f64, self.d as f64);
        let full = 4.0 * b * h * t * t * d;
        if self.causal {
            full / 2.0
        } else {
            full
        }
    }
    fn scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }
}

struct Args {
    shape: Shape,
    dtype: DType,
    reps: usize,
}

fn parse() -> R<Args> {
    let mut a = Args {
        shape: Shape {
            b: 16,
            h: 12,
            t: 1024,
            d: 64,
            causal: true,
        },
        dtype: DType::BF16,
        reps: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--batch" => a.shape.b = v.parse()?,
            "--heads" => a.shape.h = v.parse()?,
            "--seq" => a.shape.t = v.parse()?,
            "--dim" => a.shape.d = v.parse()?,
            "--causal" => a.shape.causal = v.parse()?,
            "--reps" => a.reps = v.parse::<usize>()?.max(1),
            "--dtype" => {
                a.dtype = v.parse().map_err(|e| format!("--dtype {v}: {e}"))?;
                if !a.dtype.is_float() {
                    return Err(format!("--dtype must be a float dtype, got {v}").into());
                }
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(a)
}

/// Never-zero host values of `shape` (magnitude 0.1..1, either sign) from a splitmix64 stream.
fn never_zero(shape: [usize; 4], seed: u64) -> R<Tensor> {
    let n: usize = shape.iter().product();
    let mut s = seed;
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let u = (z >> 11) as f64 / (1u64 << 53) as f64;
            let m = 0.1 + 0.9 * (u * 2.0 % 1.0);
            if u < 0.5 {
                -m
            } else {
                m
            }
        })
        .collect();
    Ok(Tensor::from_vec(v, shape.to_vec())?)
}

/// `x` (on the host) as a local tensor on the bound CUDA device.
fn to_cuda(x: &Tensor) -> R<Tensor> {
    let host = x
        .storage()
        .ok_or("a local tensor has a piece")?
        .cpu("attention_bench")?
        .clone();
    let dev = CudaStorage::from_host(&host)?;
    Ok(Tensor::from_storage(Storage::Device(Arc::new(dev))))
}

/// q, k, v and dO of `s` on the host in f64 (`dtype`-rounded values) and on the device.
struct Case {
    host: [Tensor; 4],
    dev: [Tensor; 4],
}

fn case(s: &Shape, dtype: DType, seed: u64) -> R<Case> {
    let mut host = Vec::new();
    let mut dev = Vec::new();
    for i in 0..4 {
        let x = never_zero(s.dims(), seed + i)?.cast(dtype)?;
        dev.push(to_cuda(&x)?);
        host.push(x.cast(DType::F64)?);
    }
    let four =
        |v: Vec<Tensor>| -> R<[Tensor; 4]> { v.try_into().map_err(|_| "four tensors".into()) };
    Ok(Case {
        host: four(host)?,
        dev: four(dev)?,
    })
}

/// o, lse, dq, dk, dv of `x` (q, k, v, dO) through the op and autograd.
fn run(x: &[Tensor; 4], s: &Shape) -> R<[Tensor; 5]> {
    let qkv: Vec<Tensor> = x[..3]
        .iter()
        .map(|t| t.detach().requires_grad_(true))
        .collect();
    let (o, lse) = flash_attention_lse(&qkv[0], &qkv[1], &qkv[2], s.causal, s.scale())?;
    o.backward_with(&x[3])?;
    let g = |i: usize| -> R<Tensor> {
        qkv[i]
            .grad()
            .ok_or_else(|| format!("input {i} got no gradient").into())
    };
    Ok([o, lse, g(0)?, g(1)?, g(2)?])
}

/// ‖a − b‖ / ‖b‖ over f64 values (lse rows of -inf compare as equal).
fn rel(a: &Tensor, b: &Tensor) -> R<f64> {
    let (a, b) = (a.cast(DType::F64)?.to_vec::<f64>()?, b.to_vec::<f64>()?);
    if a.len() != b.len() {
        return Err(format!("{} values against {}", a.len(), b.len()).into());
    }
    let (mut num, mut den) = (0.0, 0.0);
    for (x, y) in a.iter().zip(&b) {
        if x == y {
            den += if y.is_finite() { y * y } else { 0.0 };
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 5e-3,
        _ => 1e-4,
    }
}

/// Check rows of the device results `got` against the f64 CPU kernel on `host`; whether all
/// pass.
fn check(label: &str, s: &Shape, dtype: DType, got: &[Tensor; 5], host: &[Tensor; 4]) -> R<bool> {
    let want = run(host, s)?;
    let tol = tolerance(dtype);
    let mut ok = true;
    for (i, name) in ["fwd O", "fwd lse", "bwd dQ", "bwd dK", "bwd dV"]
        .iter()
        .enumerate()
    {
        let e = rel(&got[i], &want[i])?;
        let pass = e <= tol;
        ok &= pass;
        let dt = if i == 1 { dtype.compute() } else { dtype };
        println!(
            "| flash_attention op {name} | {dt} | {label} | {e:.2e} | {tol:.0e} | {} | vs f64 CPU kernel |",
            if pass { "pass" } else { "FAIL" }
        );
    }
    Ok(ok)
}

/// The first batch entry of `[B, ...]` tensor `x`, on the host.
fn first_entry(x: &Tensor) -> R<Tensor> {
    let host = x.cast(DType::F64)?.to_ndarray::<f64>()?;
    let mut dims = host.shape().to_vec();
    dims[0] = 1;
    let one = host
        .index_axis(ndarray::Axis(0), 0)
        .to_owned()
        .into_shape_with_order(dims)?;
    Ok(Tensor::from_array(one))
}

fn median_ms(reps: usize, rt: &cuda::CudaRuntime, mut f: impl FnMut(usize) -> R<()>) -> R<f64> {
    for i in 0..3 {
        f(i)?;
    }
    rt.synchronize()?;
    let mut ms = Vec::with_capacity(reps);
    for i in 0..reps {
        let t0 = Instant::now();
        f(i)?;
        rt.synchronize()?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("attention_bench: {e}");
            std::process::exit(2);
        }
    };
    if let Some(why) = cuda::cuda_unavailable() {
        println!("attention_bench skipped: no CUDA ({why})");
        return;
    }
    match bench(&a) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("attention_bench: {e}");
            std::process::exit(2);
        }
    }
}

fn bench(a: &Args) -> R<bool> {
    let rt = cuda::init_cuda(0)?;
    let (s, dt) = (a.shape, a.dtype);
    println!("| check | dtype | shape | ‖out − ref‖/‖ref‖ | tol | result | note |");
    println!("|---|---|---|---|---|---|---|");
    let small = Shape {
        b: 2,
        h: 3,
        t: 256,
        d: s.d,
        causal: s.causal,
    };
    let c = case(&small, dt, 1)?;
    let mut ok = check(&small.label(), &small, dt, &run(&c.dev, &small)?, &c.host)?;

    let sets = [case(&s, dt, 11)?, case(&s, dt, 21)?];
    let got = run(&sets[0].dev, &s)?;
    let slice = Shape { b: 1, ..s };
    let got0: Vec<Tensor> = got.iter().map(first_entry).collect::<R<_>>()?;
    let host0: Vec<Tensor> = sets[0].host.iter().map(first_entry).collect::<R<_>>()?;
    let label = format!("{} (batch entry 0)", s.label());
    let five: [Tensor; 5] = got0.try_into().map_err(|_| "five results")?;
    let four: [Tensor; 4] = host0.try_into().map_err(|_| "four inputs")?;
    ok &= check(&label, &slice, dt, &five, &four)?;
    drop(got);

    let fwd = median_ms(a.reps, &rt, |i| {
        let x = &sets[i % 2].dev;
        let _g = no_grad();
        flash_attention(&x[0], &x[1], &x[2], s.causal, s.scale())?;
        Ok(())
    })?;
    rt.synchronize()?;
    memory::reset_peaks();
    let base = memory::device().live;
    let fwd_bwd = median_ms(a.reps, &rt, |i| {
        run(&sets[i % 2].dev, &s)?;
        Ok(())
    })?;
    let peak = memory::device().peak.saturating_sub(base);
    let flops = s.forward_flops();
    println!();
    println!("| timing | dtype | shape | ms | rate | ceiling |");
    println!("|---|---|---|---|---|---|");
    let label = s.label();
    println!(
        "| flash_attention op fwd | {dt} | {label} | {fwd:.4} | {:.1} TFLOP/s | |",
        flops / fwd / 1e9
    );
    println!(
        "| flash_attention op fwd+bwd | {dt} | {label} | {fwd_bwd:.4} | {:.1} TFLOP/s | |",
        3.5 * flops / fwd_bwd / 1e9
    );
    println!();
    println!(
        "peak device memory of one fwd+bwd above its inputs: {:.1} MiB (inputs and dO: {:.1} MiB)",
        peak as f64 / (1 << 20) as f64,
        base as f64 / (1 << 20) as f64
    );
    for line in cuda::fused_attention_report() {
        println!("{line}");
    }
    Ok(ok)
}
