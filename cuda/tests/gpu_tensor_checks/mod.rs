//! The GPU suite's checks of the stream ordering and the CUDA backend's own paths: pipelined
//! boxing (no synchronisation between iterations), boxing leaving its input unchanged,
//! creation ops computed on the device (every dtype), bf16 matrix products, every 16-bit
//! kernel against f64 (`half.rs`), fused attention in bf16, f16 and f32 against f64
//! (`flash.rs`), sums over large pieces (`reductions.rs`), AdamW's compute copies
//! (`adamw_copies.rs`), AdamW written over its own memory
//! (`adamw_reuse.rs`), gradient buckets (`buckets.rs`), the
//! vocabulary-parallel cross-entropy kernels (`vocab.rs`), the generated fused element-wise
//! kernels against f64 (`fused.rs`), the fused linear cross-entropy against f64
//! (`linear_classifier.rs`), the fused MLP with its residual add (`residual_mlp.rs`).

use super::*;

mod adamw_copies;
mod adamw_reuse;
mod buckets;
mod flash;
mod fused;
mod half;
mod indexed;
mod linear_classifier;
mod op_cases;
mod operands;
mod reductions;
mod residual_mlp;
mod shared_input;
mod vocab;
pub(crate) use adamw_copies::child_adamw_copies;
pub(crate) use adamw_reuse::child_adamw_reuse;
pub(crate) use buckets::child_buckets;
pub(crate) use flash::child_flash;
pub(crate) use fused::child_fused_elementwise;
pub(crate) use half::child_half;
pub(crate) use indexed::run_indexed_case;
pub(crate) use linear_classifier::child_linear_classifier;
pub(crate) use op_cases::{op_strategy, run_case, sbp_of};
use operands::{
    device_leaves, f64_leaves, fused_tolerance, grad_of, random_operands, whole_values,
    within_scale, world_placement,
};
pub(crate) use reductions::child_large_reductions;
pub(crate) use residual_mlp::child_residual_mlp;
pub(crate) use shared_input::child_shared_input;
pub(crate) use vocab::child_vocab_parallel;

/// The AdamW checks' hyper-parameters (lr 1e-2, betas 0.9 and 0.95, eps 1e-8, step 3), the
/// gradients scaled by `grad_scale`.
fn adamw_hyper(grad_scale: f64) -> AdamWHyper {
    AdamWHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        step: 3,
        grad_scale,
    }
}

/// Boxes a tensor (global: `to_global`; local CPU reference: the identity).
type Boxer<'a> = dyn Fn(&Tensor, &[Sbp]) -> Result<Tensor> + 'a;
/// Makes a randn input of (shape, seed, nd-SBP).
type Maker<'a> = dyn Fn(&[usize], u64, &[Sbp]) -> Result<Tensor> + 'a;

/// Iteration `i` of the pipelined chain on a 1-d placement: S(0) -> S(1), + B bias, -> S(0)
/// -> B -> S(1), matmul with an S(0) weight ((S1,S0) -> P), P -> S(0) and P -> B. Uneven
/// [37+i, 29+2i] shapes so every iteration allocates different sizes.
pub(crate) fn chain_1d(i: usize, mk: &Maker, bx: &Boxer) -> Result<Vec<Tensor>> {
    let (r, c, k) = (37 + i, 29 + 2 * i, 3 + i % 5);
    let seed = 100 * i as u64;
    let x = mk(&[r, c], seed, &[Sbp::S(0)])?;
    let a = bx(&x, &[Sbp::S(1)])?;
    let a2 = a.add(&mk(&[c], seed + 1, &[Sbp::B])?)?;
    let b = bx(&a2, &[Sbp::S(0)])?;
    let bb = bx(&b, &[Sbp::B])?;
    let s1 = bx(&bb, &[Sbp::S(1)])?;
    let m = s1.matmul(&mk(&[c, k], seed + 2, &[Sbp::S(0)])?)?;
    let out = bx(&m, &[Sbp::S(0)])?;
    let out_b = bx(&m, &[Sbp::B])?;
    Ok(vec![a2, bb, out, out_b])
}

/// Iteration `i` on the [2, 2] mesh: (S(0),S(1)) -> (S(1),B) -> (B,S(0)), + (B,B) bias,
/// -> (B,S(1)), matmul with a (B,S(0)) weight -> (B,P), -> (S(0),B). Each mesh axis boxes on
/// its own sub-communicator.
pub(crate) fn chain_2d(i: usize, mk: &Maker, bx: &Boxer) -> Result<Vec<Tensor>> {
    let (r, c, k) = (37 + i, 29 + 2 * i, 3 + i % 5);
    let seed = 100 * i as u64 + 50;
    let x = mk(&[r, c], seed, &[Sbp::S(0), Sbp::S(1)])?;
    let y1 = bx(&x, &[Sbp::S(1), Sbp::B])?;
    let y2 = bx(&y1, &[Sbp::B, Sbp::S(0)])?;
    let y3 = y2.add(&mk(&[c], seed + 1, &[Sbp::B, Sbp::B])?)?;
    let z = bx(&y3, &[Sbp::B, Sbp::S(1)])?;
    let m = z.matmul(&mk(&[c, k], seed + 2, &[Sbp::B, Sbp::S(0)])?)?;
    let out = bx(&m, &[Sbp::S(0), Sbp::B])?;
    Ok(vec![y1, y2, out])
}

/// Pipelined boxing: 30 iterations of `chain_1d` (and `chain_2d` on 4 ranks) queued with no
/// synchronisation between them; two of every three iterations' results are kept alive, the
/// third's dropped at once (so the allocator reuses blocks while collectives may still be in
/// flight). Then every kept result is compared with the same chain on local CPU tensors.
/// Returns (iterations, iterations kept and checked, milliseconds of the queued loop + sync).
pub(crate) fn child_pipelined(
    world: usize,
    dev: DeviceType,
) -> std::result::Result<(usize, usize, f64), String> {
    const ITERS: usize = 30;
    let e = |what: &str, err: oxiflow_tensor::TensorError| format!("{what}: {err}");
    let pl1 = world_placement(world, dev)?;
    let pl2 = if world == 4 {
        Some(pl1.reshaped([2, 2]).map_err(|x| x.to_string())?)
    } else {
        None
    };
    let global = |pl: &Placement| {
        let pl = pl.clone();
        move |shape: &[usize], seed: u64, sbp: &[Sbp]| -> Result<Tensor> {
            Tensor::randn_global(
                Shape::from(shape),
                seed,
                DType::F32,
                &pl,
                NdSbp::new(sbp.iter().copied()),
            )
        }
    };
    let boxer = |pl: &Placement| {
        let pl = pl.clone();
        move |t: &Tensor, sbp: &[Sbp]| -> Result<Tensor> {
            t.to_global(&pl, NdSbp::new(sbp.iter().copied()))
        }
    };
    let local = |shape: &[usize], seed: u64, _: &[Sbp]| -> Result<Tensor> {
        Ok(Tensor::randn(Shape::from(shape), seed, DType::F32))
    };
    let same = |t: &Tensor, _: &[Sbp]| -> Result<Tensor> { Ok(t.clone()) };
    let t = Instant::now();
    // (iteration, mesh, results) of the kept iterations.
    let mut kept: Vec<(usize, usize, Vec<Tensor>)> = Vec::new();
    for i in 0..ITERS {
        let one = chain_1d(i, &global(&pl1), &boxer(&pl1)).map_err(|x| e("1-d chain", x))?;
        let two = match &pl2 {
            Some(p) => Some(chain_2d(i, &global(p), &boxer(p)).map_err(|x| e("2-d chain", x))?),
            None => None,
        };
        if i % 3 != 0 {
            kept.push((i, 1, one));
            if let Some(two) = two {
                kept.push((i, 2, two));
            }
        }
    }
    if let Some(rt) = cuda::bound_runtime() {
        rt.synchronize().map_err(|x| e("synchronize", x))?;
    }
    let ms = t.elapsed().as_secs_f64() * 1e3;
    // Every rank gathers every kept result (collectives stay matched); the first few value
    // mismatches are reported after all are compared.
    let mut iters_checked = std::collections::BTreeSet::new();
    let mut failures: Vec<String> = Vec::new();
    for (i, mesh, got) in &kept {
        let want = if *mesh == 1 {
            chain_1d(*i, &local, &same)
        } else {
            chain_2d(*i, &local, &same)
        }
        .map_err(|x| e("cpu chain", x))?;
        same_len(&format!("iteration {i} mesh {mesh}"), "results", got, &want)?;
        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = format!("iteration {i} {mesh}-d mesh result {j} ({})", g.describe());
            if g.shape() != w.shape() {
                return Err(format!("{what}: shape {} vs {}", g.shape(), w.shape()));
            }
            let gv = values(g).map_err(|x| e(&what, x))?;
            let wv = values(w).map_err(|x| e(&what, x))?;
            if let Err(x) = close(&gv, &wv) {
                failures.push(format!("{what}: {x}"));
            }
        }
        iters_checked.insert(*i);
    }
    if !failures.is_empty() {
        return Err(format!(
            "{} kept results differ from CPU; first:\n  {}",
            failures.len(),
            first_failures(&failures, 6)
        ));
    }
    Ok((ITERS, iters_checked.len(), ms))
}

/// Boxing never writes into its input: a P tensor boxed to B several times, then to S(0),
/// keeps its pieces, and both results equal the sum of the pieces (each rank's piece is
/// `randn(seed + rank)`, so every rank knows them all).
pub(crate) fn child_inputs_unchanged(
    world: usize,
    rank: usize,
    dev: DeviceType,
) -> std::result::Result<(), String> {
    let e = |what: &str, err: oxiflow_tensor::TensorError| format!("{what}: {err}");
    let pl = world_placement(world, dev)?;
    let shape = [3 * world + 1, 33];
    let piece = |r: usize| Tensor::randn(Shape::from(&shape[..]), 77 + r as u64, DType::F32);
    let p = piece(rank)
        .to_global(&pl, Sbp::P)
        .map_err(|x| e("to_global P", x))?;
    let before = values(&p.to_local()).map_err(|x| e("P piece", x))?;
    let mut bs = Vec::new();
    for _ in 0..5 {
        bs.push(p.to_global(&pl, Sbp::B).map_err(|x| e("P->B", x))?);
    }
    let s = p.to_global(&pl, Sbp::S(0)).map_err(|x| e("P->S", x))?;
    let after = values(&p.to_local()).map_err(|x| e("P piece", x))?;
    if before != after {
        return Err("boxing P->B changed its input tensor's piece".into());
    }
    let mut sum = vec![0f64; shape[0] * shape[1]];
    for r in 0..world {
        for (a, v) in sum
            .iter_mut()
            .zip(values(&piece(r)).map_err(|x| e("host piece", x))?)
        {
            *a += v;
        }
    }
    for (k, b) in bs.iter().enumerate() {
        let got = values(&b.to_local()).map_err(|x| e("B piece", x))?;
        close(&got, &sum).map_err(|x| format!("P->B result {k}: {x}"))?;
    }
    let rows = oxiflow_sbp::BalancedSplitter::new(shape[0], world).range(rank);
    let got = values(&s.to_local()).map_err(|x| e("S piece", x))?;
    close(&got, &sum[rows.start * shape[1]..rows.end * shape[1]])
        .map_err(|x| format!("P->S result: {x}"))
}

/// Creation ops on cuda placements run on the device (the pieces are device storage) and give
/// the host's values: full, arange and rand bit for bit, randn within 4 ulp (the device's
/// `log`/`cos` may round differently), for every dtype, on 1-d and 2-d meshes incl. P.
pub(crate) fn child_creation(world: usize) -> Checked {
    let e = |what: &str, err: oxiflow_tensor::TensorError| format!("{what}: {err}");
    let pl1 = Placement::new_1d(DeviceType::Cuda, (0..world).collect::<Vec<_>>())
        .map_err(|x| x.to_string())?;
    let mut layouts: Vec<(Placement, NdSbp)> = [Sbp::S(0), Sbp::S(1), Sbp::B, Sbp::P]
        .into_iter()
        .map(|s| (pl1.clone(), NdSbp::new([s])))
        .collect();
    if world == 4 {
        let pl2 = pl1.reshaped([2, 2]).map_err(|x| x.to_string())?;
        layouts.push((pl2.clone(), NdSbp::new([Sbp::S(0), Sbp::S(1)])));
        layouts.push((pl2, NdSbp::new([Sbp::P, Sbp::S(0)])));
    }
    let shape = Shape::new([13, 7]);
    let mut checked = 0;
    for (pl, sbp) in &layouts {
        let host_pl = pl.with_device(DeviceType::Cpu);
        for dtype in DType::ALL {
            for kind in 0..4 {
                let make = |p: &Placement| -> Result<Tensor> {
                    let sh = shape.clone();
                    match kind {
                        0 => Tensor::full_global(sh, 2.5, dtype, p, sbp.clone()),
                        1 => Tensor::arange_global(-3.0, 88.0, 1.0, dtype, p, sbp.clone()),
                        2 => Tensor::rand_global(sh, 41, dtype, p, sbp.clone()),
                        _ => Tensor::randn_global(sh, 42, dtype, p, sbp.clone()),
                    }
                };
                // arange is 1-d: no S(1).
                if kind == 1 && sbp.iter().any(|s| s == Sbp::S(1)) {
                    continue;
                }
                let what = format!("creation kind {kind} {dtype} on {pl} {sbp}");
                let dev = make(pl).map_err(|x| e(&what, x))?.to_local();
                let host = make(&host_pl).map_err(|x| e(&what, x))?.to_local();
                if !matches!(dev.device(), oxiflow_tensor::Device::Cuda(_)) {
                    return Err(format!(
                        "{what}: piece on {}, not created on the device",
                        dev.device()
                    ));
                }
                let (d, h) = match dtype {
                    DType::F32 => {
                        let (d, h) = (dev.to_vec::<f32>(), host.to_vec::<f32>());
                        let (d, h) = (d.map_err(|x| e(&what, x))?, h.map_err(|x| e(&what, x))?);
                        let ulp = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
                        let tol = if kind == 3 { 1 } else { 0 };
                        if let Some(i) = (0..d.len()).find(|&i| ulp(d[i], h[i]) > tol) {
                            return Err(format!("{what}: element {i}: {} vs host {}", d[i], h[i]));
                        }
                        (d.len(), h.len())
                    }
                    DType::F64 => {
                        let (d, h) = (dev.to_vec::<f64>(), host.to_vec::<f64>());
                        let (d, h) = (d.map_err(|x| e(&what, x))?, h.map_err(|x| e(&what, x))?);
                        let ulp =
                            |a: f64, b: f64| (a.to_bits() as i128 - b.to_bits() as i128).abs();
                        let tol = if kind == 3 { 4 } else { 0 };
                        if let Some(i) = (0..d.len()).find(|&i| ulp(d[i], h[i]) > tol) {
                            return Err(format!("{what}: element {i}: {} vs host {}", d[i], h[i]));
                        }
                        (d.len(), h.len())
                    }
                    DType::BF16 | DType::F16 => {
                        // The f32 values rounded once: equal bits, randn within one 16-bit ulp.
                        let bits = |t: &Tensor| -> Result<Vec<i64>> {
                            Ok(match dtype {
                                DType::BF16 => t
                                    .to_vec::<oxiflow_dtype::bf16>()?
                                    .iter()
                                    .map(|v| v.to_bits() as i64)
                                    .collect(),
                                _ => t
                                    .to_vec::<oxiflow_dtype::f16>()?
                                    .iter()
                                    .map(|v| v.to_bits() as i64)
                                    .collect(),
                            })
                        };
                        let (d, h) = (bits(&dev), bits(&host));
                        let (d, h) = (d.map_err(|x| e(&what, x))?, h.map_err(|x| e(&what, x))?);
                        let tol = if kind == 3 { 1 } else { 0 };
                        if let Some(i) = (0..d.len()).find(|&i| (d[i] - h[i]).abs() > tol) {
                            return Err(format!(
                                "{what}: element {i}: bits {:#x} vs host {:#x}",
                                d[i], h[i]
                            ));
                        }
                        (d.len(), h.len())
                    }
                    DType::I64 => {
                        let (d, h) = (dev.to_vec::<i64>(), host.to_vec::<i64>());
                        let (d, h) = (d.map_err(|x| e(&what, x))?, h.map_err(|x| e(&what, x))?);
                        if d != h {
                            return Err(format!("{what}: {d:?} vs host {h:?}"));
                        }
                        (d.len(), h.len())
                    }
                };
                if d != h {
                    return Err(format!("{what}: {d} elements vs host {h}"));
                }
                checked += 1;
            }
        }
    }
    Ok(checked)
}

/// Round to the nearest bf16 (even), as the device's f32 -> bf16 conversion.
fn bf16(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits((b.wrapping_add(0x7fff + ((b >> 16) & 1))) & 0xffff_0000)
}

/// `MatmulPrecision::Bf16`, an attribute of the matmul op: a global matmul (S(0) x B) on the
/// device at bf16 equals the product of the bf16-rounded inputs accumulated in f64 (within f32
/// accumulation error) and differs from the f32 product by bf16 rounding; the same product at
/// F32 is the f32 product.
pub(crate) fn child_bf16(world: usize) -> std::result::Result<f64, String> {
    let e = |what: &str, err: oxiflow_tensor::TensorError| format!("{what}: {err}");
    cuda::bound_runtime().ok_or("no CUDA runtime")?;
    let pl = Placement::new_1d(DeviceType::Cuda, (0..world).collect::<Vec<_>>())
        .map_err(|x| x.to_string())?;
    let (m, k, n) = (37, 300, 29);
    let a = Tensor::randn_global([m, k], 5, DType::F32, &pl, Sbp::S(0)).map_err(|x| e("a", x))?;
    let b = Tensor::randn_global([k, n], 6, DType::F32, &pl, Sbp::B).map_err(|x| e("b", x))?;
    let av = a.to_vec::<f32>().map_err(|x| e("a", x))?;
    let bv = b.to_vec::<f32>().map_err(|x| e("b", x))?;
    let reference = |round: bool| -> Vec<f64> {
        let r = |x: f32| if round { bf16(x) as f64 } else { x as f64 };
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|l| r(av[i * k + l]) * r(bv[l * n + j])).sum();
            }
        }
        c
    };
    let worst = |got: &[f32], want: &[f64]| {
        got.iter()
            .zip(want)
            .map(|(&g, &w)| (g as f64 - w).abs() / (1.0 + w.abs()))
            .fold(0f64, f64::max)
    };
    let low = a
        .matmul_at(&b, cuda::MatmulPrecision::Bf16)
        .and_then(|c| c.to_vec::<f32>())
        .map_err(|x| e("bf16 matmul", x))?;
    let full = a
        .matmul(&b)
        .and_then(|c| c.to_vec::<f32>())
        .map_err(|x| e("f32 matmul", x))?;
    let (rb, rf) = (reference(true), reference(false));
    let (err_low, err_full, gap) = (worst(&low, &rb), worst(&full, &rf), worst(&low, &rf));
    if err_low > 1e-5 || err_full > 1e-5 {
        return Err(format!(
            "bf16 product off its reference by {err_low:.2e}, f32 product by {err_full:.2e}"
        ));
    }
    if gap < 1e-4 {
        return Err(format!(
            "bf16 product within {gap:.2e} of the f32 one: the inputs were not rounded"
        ));
    }
    // Attention and its gradients under bf16 products (the probabilities and dS bring their
    // bf16 copies from the softmax kernels) against the same in f32.
    let attention = |p: cuda::MatmulPrecision| -> std::result::Result<Vec<Vec<f32>>, String> {
        let run = || -> oxiflow_tensor::Result<Vec<Vec<f32>>> {
            let mk = |seed: u64| {
                Tensor::randn_global([2, 3, 40, 16], seed, DType::F32, &pl, Sbp::B)
                    .map(|t| t.requires_grad_(true))
            };
            let (q, k, v) = (mk(7)?, mk(8)?, mk(9)?);
            let y = q.attention_probs_at(&k, true, 0.25, p)?.bmm_at(&v, p)?;
            y.square()?.mean_all()?.backward()?;
            let mut out = vec![y.to_vec::<f32>()?];
            for t in [&q, &k, &v] {
                if let Some(g) = t.grad() {
                    out.push(g.to_vec::<f32>()?);
                }
            }
            Ok(out)
        };
        run().map_err(|x| e("attention", x))
    };
    let (low, full) = (
        attention(cuda::MatmulPrecision::Bf16)?,
        attention(cuda::MatmulPrecision::F32)?,
    );
    if low.len() != 4 || full.len() != 4 {
        return Err(format!(
            "attention gave {} / {} results, want 4",
            low.len(),
            full.len()
        ));
    }
    for (i, (l, f)) in low.iter().zip(&full).enumerate() {
        let diff: f64 = l
            .iter()
            .zip(f)
            .map(|(&a, &b)| ((a - b) as f64).powi(2))
            .sum();
        let norm: f64 = f.iter().map(|&b| (b as f64).powi(2)).sum();
        let rel = (diff / norm.max(1e-30)).sqrt();
        if rel.is_nan() || rel >= 3e-2 || rel == 0.0 {
            return Err(format!(
                "bf16 attention result {i} is {rel:.2e} (relative) off the f32 one: want (0, 3e-2)"
            ));
        }
    }
    Ok(gap)
}
