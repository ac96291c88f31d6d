//! The GPU suite's 16-bit checks: every case of `half_cases` (each op family's bf16/f16
//! kernels, forward and backward) on a cuda placement against the f64 computation on the
//! same, never-zero input values. The device computes 16-bit data in f32 and rounds once per
//! kernel; an op composed of several kernels (attention, gradients) rounds once per kernel.
//! The padded classifier's gradient is also checked to be exactly 0 in the padding.

use super::*;
use crate::half_cases::{global_inputs, half_cases, local_inputs, within};
use oxiflow_ops::classifier::classifier_loss_padded;

/// The padded classifier's gradient in `dtype` on `pl` (logits with rows split, 16-byte rows
/// and unaligned ones; f64 takes the composed kernels): exactly 0 in every padded column (the
/// cases against f64 hold it only to a tolerance).
fn padding_gradient_is_zero(pl: &Placement, dtype: DType) -> std::result::Result<(), String> {
    for (rows, width, classes) in [(6usize, 16usize, 11usize), (5, 13, 9)] {
        let what =
            format!("padded classifier gradient [{rows}, {width}] over {classes} on {dtype}");
        let e = |x: oxiflow_tensor::TensorError| format!("{what}: {x}");
        let x = Tensor::randn_global([rows, width], 3, dtype, pl, NdSbp::new([Sbp::S(0)]))
            .map_err(e)?
            .requires_grad_(true);
        let ids: Vec<i64> = (0..rows as i64).map(|i| (i * 5) % classes as i64).collect();
        let t = Tensor::from_vec(ids, [rows])
            .and_then(|t| t.to_global(pl, NdSbp::new([Sbp::B])))
            .map_err(e)?;
        classifier_loss_padded(&x, &t, classes)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .map_err(e)?;
        let g = x
            .grad()
            .ok_or_else(|| format!("{what}: no gradient"))?
            .cast(DType::F64)
            .and_then(|g| g.to_vec::<f64>())
            .map_err(e)?;
        for (i, row) in g.chunks(width).enumerate() {
            if let Some(j) = (classes..width).find(|&j| row[j] != 0.0) {
                return Err(format!("{what}: row {i} column {j} is {}", row[j]));
            }
            if row[..classes].iter().all(|&v| v == 0.0) {
                return Err(format!("{what}: row {i} has no class gradient"));
            }
        }
    }
    Ok(())
}

/// Runs every case in bf16 and f16 on a 1-d placement of `world` ranks of `dev`; the number
/// of (case, dtype) pairs within their rounding of the f64 reference (and of dtypes whose
/// padded classifier gradient is exactly 0 in the padding).
pub(crate) fn child_half(world: usize, dev: DeviceType) -> Checked {
    let pl = world_placement(world, dev)?;
    let values = |t: &Tensor| t.cast(DType::F64)?.to_vec::<f64>();
    let mut checked = 0;
    let mut failures = Vec::new();
    for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64] {
        match padding_gradient_is_zero(&pl, dtype) {
            Ok(()) => checked += 1,
            Err(e) => failures.push(e),
        }
    }
    for dtype in [DType::BF16, DType::F16] {
        for (k, c) in half_cases().iter().enumerate() {
            let seed = 1000 * k as u64 + 7;
            let what = format!("{} on {dtype} ({dev})", c.name);
            let reference = local_inputs(c, dtype, seed)
                .and_then(|v| {
                    let f64s = v
                        .into_iter()
                        .map(|t| match t.dtype() {
                            DType::I64 => Ok(t),
                            _ => t.cast(DType::F64),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    (c.op)(&f64s)
                })
                .and_then(|t| values(&t))
                .map_err(|x| format!("{what}: reference: {x}"))?;
            // Every rank runs every case (collectives stay matched) and reports the first
            // failures.
            let got = global_inputs(c, dtype, seed, &pl).and_then(|x| {
                let y = (c.op)(&x)?;
                if y.placement().is_some_and(|p| p.device() != dev) {
                    return Err(oxiflow_tensor::TensorError::Kernel {
                        op: "half",
                        detail: format!("left the {dev} placement"),
                    });
                }
                values(&y)
            });
            match got {
                Ok(g) => match within(&g, &reference, dtype, 2.0 * c.ulps + 2.0) {
                    Ok(()) => checked += 1,
                    Err(e) => failures.push(format!("{what}: {e}")),
                },
                Err(e) => failures.push(format!("{what}: {e}")),
            }
        }
    }
    passed_or_first(
        checked,
        &failures,
        format!("{} 16-bit cases", failures.len()),
        8,
    )
}
