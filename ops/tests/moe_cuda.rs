//! The mixture-of-experts CUDA kernels against an f64 reference on the host: the routed product
//! (plain and transposed) and its weight gradient in f32, bf16 and f16 with an expert no row
//! reaches, empty rows, and many rows; the router's top-k equal to the CPU kernel's on the
//! same probabilities (ties and NaN included); autograd through the product on the device; the
//! routed SwiGLU experts (forward and backward) against the CPU kernel in f64; an out-of-range
//! id a typed error. Without a CUDA device it prints that it was skipped.

mod common;

use common::{close, expert_matmul_reference, expert_wgrad_reference, vals};

use oxiflow_ops::moe::routed::routed_experts;
use oxiflow_ops::moe::{expert_matmul, expert_matmul_wgrad, router_topk};
use oxiflow_tensor::{DType, NdSbp, Placement, Tensor};

/// Expert ids of `m` rows over `experts` experts from `seed`, never the last expert (so one
/// expert gets no row).
fn ids_of(m: usize, experts: usize, seed: u64) -> Vec<i64> {
    common::expert_ids(m, experts - 1, seed)
}

/// Random never-zero values `[dims]` (magnitudes in [0.25, 1.25)) of `dt`, and their f64
/// values after rounding to `dt`.
fn values(dims: [usize; 2], seed: u64, dt: DType) -> (Tensor, Vec<f64>) {
    let r = Tensor::randn(dims, seed, DType::F64)
        .to_vec::<f64>()
        .unwrap();
    let v: Vec<f64> = r
        .iter()
        .map(|x| x.signum() * (0.25 + (x.abs() % 1.0)))
        .collect();
    let t = Tensor::from_vec(v, dims).unwrap().cast(dt).unwrap();
    let rounded = vals(&t);
    (t, rounded)
}

/// Asserts every element of `got` is within `rel` times the larger of its own size and the
/// root mean square of `want` (at least 1) of `want`'s.
fn within_rms(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len().max(1) as f64).sqrt();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rel * rms.max(w.abs()).max(1.0);
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: {g} vs {w} (tolerance {tol}, rms {rms})"
        );
    }
}

fn on_device(t: &Tensor, p: &Placement) -> Tensor {
    t.to_global(p, NdSbp::broadcast(1)).unwrap()
}

fn tolerance(dt: DType, inner: usize) -> f64 {
    let unit = match dt {
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        _ => 8e-3,
    };
    unit * (inner as f64).sqrt().max(4.0)
}

#[test]
fn expert_products_on_cuda_match_the_f64_reference() {
    let Some((_world, p)) = common::cuda_device_or_skip("moe_cuda") else {
        return;
    };
    let experts = 5;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (m, k, n, seed) in [
            (0usize, 8usize, 6usize, 1u64),
            (37, 24, 40, 2),
            (4096, 64, 96, 3),
        ] {
            let ids = ids_of(m, experts, seed);
            let id_t = on_device(&Tensor::from_vec(ids.clone(), [m]).unwrap(), &p);
            let (x, xv) = values([m, k], seed + 10, dt);
            let (dy, dyv) = values([m, n], seed + 20, dt);
            let (ws, wv): (Vec<Tensor>, Vec<Vec<f64>>) = (0..experts)
                .map(|e| values([k, n], seed + 30 + e as u64, dt))
                .map(|(t, v)| (on_device(&t, &p), v))
                .unzip();
            let (x, dy) = (on_device(&x, &p), on_device(&dy, &p));
            let tol = tolerance(dt, k.max(n).max(m / experts));
            // y = x @ w[id]
            let y = vals(&expert_matmul(&x, &id_t, &ws, false).unwrap());
            let want = expert_matmul_reference(&xv, &ids, &wv, k, n, false);
            close(&y, &want, tol, &format!("{dt} [{m}, {k}] x [{k}, {n}]"));
            // dx = dy @ w[id]^T
            let dx = vals(&expert_matmul(&dy, &id_t, &ws, true).unwrap());
            let want = expert_matmul_reference(&dyv, &ids, &wv, k, n, true);
            close(&dx, &want, tol, &format!("{dt} transposed [{m}, {n}]"));
            // g[e] = sum x^T dy over e's rows (the last expert none: zeros)
            let g = expert_matmul_wgrad(&x, &id_t, &dy, experts).unwrap();
            let wants = expert_wgrad_reference(&xv, &ids, &dyv, experts, k, n);
            for (e, (ge, want)) in g.iter().zip(&wants).enumerate() {
                let tol = tolerance(dt, m.max(1));
                close(
                    &vals(ge),
                    want,
                    tol,
                    &format!("{dt} wgrad expert {e} of {m} rows"),
                );
            }
        }
    }
}

#[test]
fn autograd_through_the_product_on_cuda_equals_the_cpu() {
    let Some((_world, p)) = common::cuda_device_or_skip("moe_cuda") else {
        return;
    };
    let (m, k, n, experts) = (64, 16, 12, 4);
    let ids = Tensor::from_vec(ids_of(m, experts, 9), [m]).unwrap();
    let (x, _) = values([m, k], 11, DType::F32);
    let ws: Vec<Tensor> = (0..experts)
        .map(|e| values([k, n], 12 + e as u64, DType::F32).0)
        .collect();
    let run = |on: Option<&Placement>| {
        // A fresh leaf each run (a clone shares its original's autograd state).
        let put = |t: &Tensor| match on {
            Some(p) => on_device(&t.detach(), p).detach(),
            None => t.detach(),
        };
        let x = put(&x).requires_grad_(true);
        let ws: Vec<Tensor> = ws.iter().map(|w| put(w).requires_grad_(true)).collect();
        let y = expert_matmul(&x, &put(&ids), &ws, false).unwrap();
        y.mul(&y).unwrap().sum_all().unwrap().backward().unwrap();
        let mut out = vec![vals(&x.grad().unwrap())];
        out.extend(ws.iter().map(|w| vals(&w.grad().unwrap())));
        out
    };
    let (cpu, cuda) = (run(None), run(Some(&p)));
    for (i, (a, b)) in cuda.iter().zip(&cpu).enumerate() {
        close(a, b, 1e-4, &format!("gradient {i}"));
    }
}

#[test]
fn router_topk_on_cuda_equals_the_cpu_kernel() {
    let Some((_world, p)) = common::cuda_device_or_skip("moe_cuda") else {
        return;
    };
    for dt in [DType::F32, DType::F64] {
        for (m, e, k) in [
            (0usize, 4usize, 2usize),
            (9, 8, 2),
            (2048, 60, 4),
            (3, 3, 3),
            (70_000, 8, 2),
        ] {
            let r = Tensor::randn([m, e], 5, DType::F64)
                .to_vec::<f64>()
                .unwrap();
            // Quarter steps make ties; the first row holds NaN and equal values.
            let mut v: Vec<f64> = r.iter().map(|x| (x * 4.0).round() / 4.0).collect();
            if m > 0 {
                v[0] = f64::NAN;
                v[1..e].iter_mut().for_each(|x| *x = 0.5);
            }
            let probs = Tensor::from_vec(v, [m, e]).unwrap().cast(dt).unwrap();
            let (cpu_ids, cpu_counts) = router_topk(&probs, k).unwrap();
            let (ids, counts) = router_topk(&on_device(&probs, &p), k).unwrap();
            assert_eq!(
                ids.to_vec::<i64>().unwrap(),
                cpu_ids.to_vec::<i64>().unwrap(),
                "{dt} [{m}, {e}] top {k}"
            );
            assert_eq!(vals(&counts), vals(&cpu_counts), "{dt} counts");
        }
    }
}

#[test]
fn an_out_of_range_id_is_a_typed_error_on_cuda() {
    let Some((_world, p)) = common::cuda_device_or_skip("moe_cuda") else {
        return;
    };
    let x = on_device(&values([3, 2], 1, DType::F32).0, &p);
    let ws = vec![on_device(&values([2, 4], 2, DType::F32).0, &p); 2];
    let ids = on_device(&Tensor::from_vec(vec![0i64, 2, 1], [3]).unwrap(), &p);
    let e = expert_matmul(&x, &ids, &ws, false).unwrap_err().to_string();
    assert!(
        e.contains("expert_matmul") && e.contains("expert 2 of 2"),
        "{e}"
    );
}

#[test]
fn routed_experts_on_cuda_match_the_f64_cpu_kernel() {
    let Some((_world, p)) = common::cuda_device_or_skip("moe_cuda") else {
        return;
    };
    let experts = 5;
    for dt in [DType::F32, DType::BF16] {
        for (m, c, f, seed) in [(0usize, 8usize, 12usize, 40u64), (300, 32, 48, 41)] {
            let ids = Tensor::from_vec(ids_of(m, experts, seed), [m]).unwrap();
            let x = values([m, c], seed + 1, dt).0;
            let stacked = |shape: [usize; 3], s: u64| {
                let v = values([shape[0], shape[1] * shape[2]], s, dt).0;
                v.reshape(shape).unwrap()
            };
            let (gate, up, down) = (
                stacked([experts, c, f], seed + 2),
                stacked([experts, c, f], seed + 3),
                stacked([experts, f, c], seed + 4),
            );
            let r = values([m, c], seed + 5, dt).0;
            // Forward and gradients of sum(y * r): on the device in `dt`, on the CPU in f64.
            let run = |on: Option<&Placement>, wide: bool| {
                let put = |t: &Tensor| {
                    let t = if wide {
                        t.cast(DType::F64).unwrap()
                    } else {
                        t.clone()
                    };
                    match on {
                        Some(p) => on_device(&t, p).detach().requires_grad_(true),
                        None => t.detach().requires_grad_(true),
                    }
                };
                let (xv, gv, uv, dv) = (put(&x), put(&gate), put(&up), put(&down));
                let idv = match on {
                    Some(p) => on_device(&ids, p),
                    None => ids.clone(),
                };
                let y = routed_experts(&xv, &idv, &gv, &uv, &dv).unwrap();
                let rv = put(&r).detach();
                y.mul(&rv).unwrap().sum_all().unwrap().backward().unwrap();
                let grads = [&xv, &gv, &uv, &dv].map(|t| vals(&t.grad().unwrap()));
                (vals(&y), grads)
            };
            let (want_y, want_g) = run(None, true);
            let (got_y, got_g) = run(Some(&p), false);
            // 16-bit runs round the hidden activations the f64 kernel keeps whole: errors
            // scale with the values' size, not with an element that cancels to near zero.
            let tol = match dt {
                DType::F32 => 1e-4,
                _ => 2e-2,
            };
            within_rms(
                &got_y,
                &want_y,
                tol,
                &format!("{dt} routed experts, {m} rows"),
            );
            for (i, (g, w)) in got_g.iter().zip(&want_g).enumerate() {
                within_rms(
                    g,
                    w,
                    tol,
                    &format!("{dt} routed experts gradient {i}, {m} rows"),
                );
            }
        }
    }
}
