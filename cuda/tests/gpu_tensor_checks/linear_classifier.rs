//! The GPU suite's check of the fused linear cross-entropy (`linear_classifier_loss_sum`):
//! rows split over the world's ranks (uneven), the table whole, against the f64 reference of
//! the loss and both gradients on random never-zero data, in f32, bf16, f16 and f64 (the
//! composed kernels), padding classes included; and rows wide enough that the chunked kernel
//! runs several chunks of logits.

use super::*;
use crate::common::linear_cross_entropy_reference;
use oxiflow_ops::linear_classifier::linear_classifier_loss_sum;

/// Checks every (shape, dtype) case on a 1-d placement of `world` ranks of `dev`; the number
/// of cases checked.
pub(crate) fn child_linear_classifier(world: usize, dev: DeviceType) -> Checked {
    let pl = world_placement(world, dev)?;
    let b = vec![Sbp::B];
    let mut checked = 0;
    // (rows, width, table rows, classes, dtypes): padding classes; a row longer than a block;
    // 1 MiB rows of bf16 logits, so 600 rows run as several chunks.
    let all = [DType::F32, DType::BF16, DType::F16, DType::F64];
    let cases: [(usize, usize, usize, usize, &[DType]); 3] = [
        (37, 24, 1000, 997, &all),
        (9, 64, 4099, 4099, &all),
        (600, 4, 1 << 19, (1 << 19) - 5, &[DType::BF16]),
    ];
    for (k, &(rows, width, v, classes, dtypes)) in cases.iter().enumerate() {
        // The chunked case is the device kernel's; the host's self-check skips its size.
        if rows * v > 1 << 24 && dev == DeviceType::Cpu {
            continue;
        }
        for &dtype in dtypes {
            let what = format!(
                "linear classifier [{rows}, {width}] x [{v}, {width}] over {classes} in {dtype}"
            );
            let e = |x: oxiflow_tensor::TensorError| format!("{what}: {x}");
            let seed = 300 + k as u64;
            let x = Tensor::randn([rows, width], seed, dtype);
            let w = Tensor::randn([v, width], seed + 1, dtype);
            let t: Vec<i64> = (0..rows as i64)
                .map(|i| (i * 7919 + 3) % classes as i64)
                .collect();
            let (xv, wv) = (values(&x).map_err(e)?, values(&w).map_err(e)?);
            if xv.iter().chain(&wv).any(|&a| a == 0.0) {
                return Err(format!("{what}: a zero input"));
            }
            let c = 0.75;
            let (want_l, want_dx, want_dw) =
                linear_cross_entropy_reference(&xv, &wv, (rows, width, v), classes, &t, c);
            let xg = x
                .to_global(&pl, b.clone())
                .and_then(|x| x.to_global(&pl, vec![Sbp::S(0)]));
            let xg = xg.map_err(e)?.requires_grad_(true);
            let wg = w.to_global(&pl, b.clone()).map_err(e)?.requires_grad_(true);
            let tg = Tensor::from_vec(t, [rows])
                .and_then(|t| t.to_global(&pl, b.clone()))
                .and_then(|t| t.to_global(&pl, vec![Sbp::S(0)]))
                .map_err(e)?;
            let loss = linear_classifier_loss_sum(&xg, &wg, &tg, classes).map_err(e)?;
            let scaled = loss.mul_scalar(c).map_err(e)?;
            scaled.backward().map_err(e)?;
            let whole = |t: &Tensor| whole_values(&pl, t);
            let no_grad = |what: &str| format!("{what}: no gradient");
            let gx = xg.grad().ok_or_else(|| no_grad(&what))?;
            let gw = wg.grad().ok_or_else(|| no_grad(&what))?;
            let (l, dx, dw) = (
                whole(&scaled).map_err(e)?,
                whole(&gx).map_err(e)?,
                whole(&gw).map_err(e)?,
            );
            // 16-bit data: logits and gradients rounded once each, sums in f32.
            let tol = fused_tolerance(dtype, 2e-4);
            if (l[0] - want_l).abs() > tol * (1.0 + want_l.abs()) {
                return Err(format!("{what}: loss {} vs {want_l}", l[0]));
            }
            for (name, got, want) in [("dx", &dx, &want_dx), ("dw", &dw, &want_dw)] {
                within_scale(name, got, want, tol).map_err(|x| format!("{what}: {x}"))?;
            }
            if dw[classes * width..].iter().any(|&g| g != 0.0) {
                return Err(format!("{what}: a padding row's gradient is not 0"));
            }
            checked += 1;
        }
    }
    Ok(checked)
}
