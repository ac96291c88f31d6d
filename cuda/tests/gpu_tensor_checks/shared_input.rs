//! The GPU suite's check of input gradients summed inside their consumers' backward kernels
//! (`Grad::take_partial`): an input shared by three linear layers (the Q, K and V
//! projections: the second and third add the gradient so far as their product's C operand,
//! `matmul_t_acc`) and a LayerNorm with learned parameters (its fused backward adds it as the
//! residual gradient), rows split over the world's ranks, against the same graph in f64 on the
//! host, on random never-zero data in f32, bf16, f16 and f64.

use super::*;
use oxiflow_ops::linear::linear;
use oxiflow_ops::linear::Activation;

/// The input's gradient of `sum(LN(x) r0) + sum_i sum((x w_i + b_i) r_i)` for `ins` = x, the
/// LayerNorm's weight and bias, then (w_i, b_i, r_i) for the three layers and r0.
fn x_grad(ins: &[Tensor], whole: &dyn Fn(&Tensor) -> Result<Vec<f64>>) -> Result<Vec<f64>> {
    let err = |d: &str| oxiflow_tensor::TensorError::Kernel {
        op: "shared input check",
        detail: d.into(),
    };
    let [x, lw, lb, rest @ ..] = ins else {
        return Err(err("too few inputs"));
    };
    let mut loss = x.layer_norm(lw, lb, 1e-5)?.mul(&rest[9])?.sum_all()?;
    for l in rest[..9].chunks(3) {
        let y = linear(x, &l[0], Some(&l[1]), Activation::None)?;
        loss = loss.add(&y.mul(&l[2])?.sum_all()?)?;
    }
    loss.backward()?;
    whole(&x.grad().ok_or_else(|| err("no gradient"))?)
}

/// Checks every (shape, dtype) case on a 1-d placement of `world` ranks of `dev`; the number
/// of cases checked.
pub(crate) fn child_shared_input(world: usize, dev: DeviceType) -> Checked {
    let pl = world_placement(world, dev)?;
    let mut checked = 0;
    for (k, &(rows, c)) in [(37usize, 64usize), (256, 768)].iter().enumerate() {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let what = format!("shared input [{rows}, {c}] in {dtype}");
            let e = |x: oxiflow_tensor::TensorError| format!("{what}: {x}");
            let mut shapes = vec![vec![rows, c], vec![c], vec![c]];
            for _ in 0..3 {
                shapes.extend([vec![c, c], vec![c], vec![rows, c]]);
            }
            shapes.push(vec![rows, c]);
            let weight = |i: usize| shapes[i].len() == 2 && shapes[i][0] == c;
            let made = random_operands(&shapes, 700 + 20 * k as u64, dtype, weight).map_err(e)?;
            // x and the LayerNorm's parameters need gradients (its fused backward then runs).
            let grads = |i: usize| i < 3;
            let reference = f64_leaves(&made, grads).map_err(e)?;
            let want = x_grad(&reference, &|t| values(t)).map_err(e)?;
            let rows_split = |i: usize| shapes[i].first() == Some(&rows) && shapes[i].len() == 2;
            let device = device_leaves(&made, &pl, rows_split, grads).map_err(e)?;
            let whole = |t: &Tensor| whole_values(&pl, t);
            let got = x_grad(&device, &whole).map_err(e)?;
            let tol = fused_tolerance(dtype, 2e-3);
            within_scale("dx", &got, &want, tol).map_err(|x| format!("{what}: {x}"))?;
            checked += 1;
        }
    }
    Ok(checked)
}
