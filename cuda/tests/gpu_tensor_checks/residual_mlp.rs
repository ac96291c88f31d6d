//! The GPU suite's check of the fused MLP with its residual add (`residual_mlp`): rows split
//! over the world's ranks, weights whole, against the same layers unfused in f64 on the host
//! (output and every gradient), on random never-zero data in f32, bf16, f16 and f64 (the
//! composed kernels), at a small shape and GPT-2's widths, keeping GELU's output or computing
//! it again in the backward.

use super::*;
use oxiflow_ops::linear::linear;
use oxiflow_ops::linear::Activation;
use oxiflow_ops::residual_mlp::residual_mlp_with;
use oxiflow_tensor::MatmulPrecision;

/// y and the gradients of `sum(y * r)` w.r.t. x, w_fc, b_fc, w_proj, b_proj, residual.
/// `fused`: None for the unfused layers, else whether GELU's output is computed again.
fn outputs(
    ins: &[Tensor],
    fused: Option<bool>,
    whole: &dyn Fn(&Tensor) -> Result<Vec<f64>>,
) -> Result<Vec<Vec<f64>>> {
    let [x, w_fc, b_fc, w_proj, b_proj, res, r] = ins else {
        return Err(oxiflow_tensor::TensorError::Kernel {
            op: "residual mlp check",
            detail: "7 inputs".into(),
        });
    };
    let y = match fused {
        Some(recompute) => residual_mlp_with(
            x,
            w_fc,
            b_fc,
            w_proj,
            b_proj,
            res,
            (recompute, MatmulPrecision::F32),
        )?,
        None => {
            let h = linear(x, w_fc, Some(b_fc), Activation::Gelu)?;
            res.add(&linear(&h, w_proj, Some(b_proj), Activation::None)?)?
        }
    };
    y.mul(r)?.sum_all()?.backward()?;
    let mut out = vec![whole(&y)?];
    for t in &ins[..6] {
        out.push(whole(&grad_of(t, "residual mlp check")?)?);
    }
    Ok(out)
}

/// Checks every (shape, dtype) case on a 1-d placement of `world` ranks of `dev`; the number
/// of cases checked.
pub(crate) fn child_residual_mlp(world: usize, dev: DeviceType) -> Checked {
    let pl = world_placement(world, dev)?;
    let mut checked = 0;
    for (k, &(rows, c, f)) in [(37usize, 64usize, 256usize), (256, 768, 3072)]
        .iter()
        .enumerate()
    {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let what = format!("residual mlp [{rows}, {c}] -> {f} in {dtype}");
            let e = |x: oxiflow_tensor::TensorError| format!("{what}: {x}");
            let shapes = [
                vec![rows, c],
                vec![c, f],
                vec![f],
                vec![f, c],
                vec![c],
                vec![rows, c],
                vec![rows, c],
            ];
            let weight = |i: usize| i == 1 || i == 3;
            let made = random_operands(&shapes, 500 + 10 * k as u64, dtype, weight).map_err(e)?;
            let reference = f64_leaves(&made, |i| i < 6).map_err(e)?;
            let want = outputs(&reference, None, &|t| values(t)).map_err(e)?;
            for recompute in [false, true] {
                let rows_split = |i: usize| matches!(i, 0 | 5 | 6);
                let device = device_leaves(&made, &pl, rows_split, |i| i < 6).map_err(e)?;
                let whole = |t: &Tensor| whole_values(&pl, t);
                let got = outputs(&device, Some(recompute), &whole).map_err(e)?;
                let tol = fused_tolerance(dtype, 2e-3);
                let names = [
                    "y",
                    "dx",
                    "dw_fc",
                    "db_fc",
                    "dw_proj",
                    "db_proj",
                    "dresidual",
                ];
                for ((name, g), w) in names.iter().zip(&got).zip(&want) {
                    within_scale(name, g, w, tol)
                        .map_err(|x| format!("{what} (recompute {recompute}): {x}"))?;
                }
                checked += 1;
            }
        }
    }
    Ok(checked)
}
