//! The GPU suite's fused attention check: `flash_attention` on a placement of `dev` (batch
//! split, heads split, broadcast) in bf16, f16 and f32 (on cuda also f32 under bf16 matrix
//! products), forward (o, lse) and backward (dq, dk, dv through autograd), against the op's f64
//! CPU kernel on the same never-zero values (rounded to the dtype first, so only the kernels'
//! error counts): shapes of the cuDNN route (T == S, Dv == D <= 256, causal and not, a head size
//! cuDNN may refuse) and of the composed one (S != T, Dv != D), each with as many key/value
//! heads as query heads and grouped (G < H, G = 1 included; the f64 reference is the CPU
//! kernel, itself checked against repeated heads).

use super::*;
use crate::half_cases::{input_values, Input};
use oxiflow_ops::attention::flash_attention_lse_at;
use oxiflow_tensor::MatmulPrecision;

/// (B, T, S, H, G, D, Dv, causal): G key/value heads for H query heads.
type Case = (usize, usize, usize, usize, usize, usize, usize, bool);
const CASES: [Case; 8] = [
    (2, 128, 128, 4, 4, 64, 64, true),
    (2, 96, 96, 3, 3, 64, 64, false),
    (1, 70, 70, 2, 2, 40, 40, true),
    (2, 33, 47, 2, 2, 16, 8, false),
    (2, 128, 128, 8, 2, 64, 64, true),
    (2, 96, 96, 6, 3, 64, 64, false),
    (1, 70, 70, 4, 1, 40, 40, true),
    (2, 33, 47, 4, 2, 16, 8, false),
];

/// o, lse, dq, dk, dv of `x` (q, k, v, dO) through the op (its f32 products at `precision`)
/// and autograd, as f64 values.
fn run(x: &[Tensor], attrs: (bool, f64), precision: MatmulPrecision) -> Result<Vec<Vec<f64>>> {
    let qkv: Vec<Tensor> = x[..3]
        .iter()
        .map(|t| t.detach().requires_grad_(true))
        .collect();
    let (o, lse) = flash_attention_lse_at(&qkv[0], &qkv[1], &qkv[2], attrs, precision)?;
    o.backward_with(&x[3])?;
    let mut out = vec![o, lse];
    for t in &qkv {
        out.push(
            t.grad()
                .ok_or_else(|| oxiflow_tensor::TensorError::Kernel {
                    op: "flash check",
                    detail: "an input got no gradient".into(),
                })?,
        );
    }
    out.iter()
        .map(|t| t.cast(DType::F64)?.to_vec::<f64>())
        .collect()
}

/// ‖a − b‖ / ‖b‖ (rows of -inf on both sides agree).
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        if x != y {
            num += (x - y) * (x - y);
        }
        if y.is_finite() {
            den += y * y;
        }
    }
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Runs every case, dtype and layout on a 1-d placement of `world` ranks of `dev`; the number
/// of (case, dtype, layout) runs within tolerance of the f64 reference.
pub(crate) fn child_flash(world: usize, dev: DeviceType) -> Checked {
    let pl = world_placement(world, dev)?;
    let on_cuda = cuda::bound_runtime().is_some() && dev == DeviceType::Cuda;
    let mut runs = vec![
        (DType::BF16, false, 1e-2),
        (DType::F16, false, 5e-3),
        (DType::F32, false, 1e-4),
    ];
    if on_cuda {
        runs.push((DType::F32, true, 3e-2));
    }
    let names = ["o", "lse", "dq", "dk", "dv"];
    let (mut checked, mut failures) = (0, Vec::new());
    for (ci, &(b, t, s, h, g, d, dv, causal)) in CASES.iter().enumerate() {
        let shapes = [
            vec![b, t, h, d],
            vec![b, s, g, d],
            vec![b, s, g, dv],
            vec![b, t, h, dv],
        ];
        let scale = 1.0 / (d as f64).sqrt();
        for &(dtype, bf16_products, tol) in &runs {
            let seed = 100 * ci as u64;
            let values: Vec<Vec<f64>> = shapes
                .iter()
                .enumerate()
                .map(|(i, sh)| input_values(sh, Input::Float, dtype, seed + i as u64))
                .collect();
            let local = |dt: DType| -> Result<Vec<Tensor>> {
                values
                    .iter()
                    .zip(&shapes)
                    .map(|(v, sh)| Tensor::from_vec(v.clone(), sh.clone())?.cast(dt))
                    .collect()
            };
            let what = format!(
                "flash {:?} {dtype}{} ({dev})",
                CASES[ci],
                if bf16_products { " bf16 products" } else { "" }
            );
            let want = local(DType::F64)
                .and_then(|x| run(&x, (causal, scale), MatmulPrecision::F32))
                .map_err(|e| format!("{what}: reference: {e}"))?;
            for sbp in [Sbp::S(0), Sbp::S(2), Sbp::B] {
                let got = local(dtype).and_then(|x| {
                    let x = x
                        .into_iter()
                        .map(|t| t.to_global(&pl, Sbp::B)?.to_global(&pl, sbp))
                        .collect::<Result<Vec<_>>>()?;
                    let precision = if bf16_products {
                        MatmulPrecision::Bf16
                    } else {
                        MatmulPrecision::F32
                    };
                    run(&x, (causal, scale), precision)
                });
                match got {
                    Ok(g) => {
                        let bad: Vec<String> = g
                            .iter()
                            .zip(&want)
                            .zip(names)
                            .map(|((a, w), n)| (n, rel(a, w)))
                            .filter(|(_, e)| e.is_nan() || *e > tol)
                            .map(|(n, e)| format!("{n} {e:.2e}"))
                            .collect();
                        if bad.is_empty() {
                            checked += 1;
                        } else {
                            failures.push(format!(
                                "{what} {sbp:?}: over {tol:.0e}: {}",
                                bad.join(", ")
                            ));
                        }
                    }
                    Err(e) => failures.push(format!("{what} {sbp:?}: {e}")),
                }
            }
        }
    }
    passed_or_first(
        checked,
        &failures,
        format!("{} fused attention runs", failures.len()),
        8,
    )
}
