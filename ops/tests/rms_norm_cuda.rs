//! Fused RMS normalisation's CUDA kernels (through the library's NVRTC path) against an f64
//! reference on random, never-zero data: forward and backward for f32, f64, bf16 and f16,
//! empty, narrow, Llama-wide and very wide rows, rows split over a device placement. Without a
//! CUDA device it prints that it was skipped.

mod common;

use common::vals;

use oxiflow_ops::rms_norm::{rms_norm, rms_norm_backward, wide};
use oxiflow_tensor::{DType, NdSbp, Sbp, Tensor};

const EPS: f64 = 1e-6;

/// Random host values in ±[0.1, 2.1) (never zero), rounded to `dt`, as f64.
fn nonzero(n: usize, seed: u64, dt: DType) -> Vec<f64> {
    let u = Tensor::randn([n], seed, DType::F64);
    let v: Vec<f64> = vals(&u)
        .iter()
        .map(|&x| x.signum() * (0.1 + x.abs().min(2.0)))
        .collect();
    vals(&Tensor::from_vec(v, [n]).unwrap().cast(dt).unwrap())
}

#[test]
fn rms_norm_on_cuda_matches_the_f64_reference() {
    let Some((_world, p)) = common::cuda_device_or_skip("rms_norm_cuda") else {
        return;
    };
    let on_device = |v: &[f64], shape: Vec<usize>, dt: DType, sbp: Sbp| {
        Tensor::from_vec(v.to_vec(), shape)
            .unwrap()
            .cast(dt)
            .unwrap()
            .to_global(&p, NdSbp::broadcast(1))
            .unwrap()
            .to_global(&p, NdSbp::new([sbp]))
            .unwrap()
    };
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (rows, h) in [
            (0usize, 8usize),
            (7, 5),
            (33, 2048),
            (3, 70_001),
            (1 << 12, 64),
            (1, 8192),
            (2, 8193),
            (300, 300),
        ] {
            let (xv, wv, dv) = (
                nonzero(rows * h, 1, dt),
                nonzero(h, 2, dt),
                nonzero(rows * h, 3, dt),
            );
            let x = on_device(&xv, vec![rows, h], dt, Sbp::S(0));
            let w = on_device(&wv, vec![h], dt, Sbp::B);
            let dy = on_device(&dv, vec![rows, h], dt, Sbp::S(0));
            let y = vals(&rms_norm(&x, &w, EPS).unwrap());
            let (dx, terms) = rms_norm_backward(&x, &w, &dy, EPS).unwrap();
            assert_eq!(terms.dtype(), wide(dt));
            let (dx, terms) = (vals(&dx), vals(&terms));
            let tol = match dt {
                DType::F64 => 1e-12,
                DType::F32 => 2e-5,
                _ => 2e-2,
            };
            for row in 0..rows {
                let xr = &xv[row * h..(row + 1) * h];
                let dr = &dv[row * h..(row + 1) * h];
                let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / h as f64 + EPS).sqrt();
                let proj = (0..h).map(|j| dr[j] * wv[j] * xr[j] * r).sum::<f64>() / h as f64;
                for j in 0..h {
                    let i = row * h + j;
                    let want = [
                        xr[j] * r * wv[j],
                        r * (dr[j] * wv[j] - xr[j] * r * proj),
                        dr[j] * xr[j] * r,
                    ];
                    for (got, w) in [y[i], dx[i], terms[i]].into_iter().zip(want) {
                        assert!(
                            (got - w).abs() <= tol * w.abs().max(1.0),
                            "{dt} [{rows}, {h}] element {i}: {got} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
