//! What the fused-kernel checks share: their random operands (weights scaled so products stay
//! O(1)), those operands as f64 leaves for the host's reference and as global leaves on the
//! world's placement, and the comparison against the reference relative to its largest value.

use super::*;

/// A 1-d placement of the world's ranks `0..world` on `dev`.
pub(crate) fn world_placement(
    world: usize,
    dev: DeviceType,
) -> std::result::Result<Placement, String> {
    Placement::new_1d(dev, (0..world).collect::<Vec<_>>()).map_err(|x| x.to_string())
}

/// The values of global tensor `t`, gathered whole (broadcast on `pl`), in f64.
pub(crate) fn whole_values(pl: &Placement, t: &Tensor) -> Result<Vec<f64>> {
    t.to_global(pl, vec![Sbp::B]).and_then(|t| values(&t))
}

/// The tolerance of a fused check in `dtype` against its f64 reference (relative to the
/// reference's largest value): `f32` for f32, the 16-bit types' 2^-5, 1e-10 for f64.
pub(crate) fn fused_tolerance(dtype: DType, f32: f64) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => f32,
        _ => 2f64.powi(-5),
    }
}

/// Random tensors of `shapes` in `dtype`, the `i`-th from seed `seed + i`; those where
/// `weight(i)` holds scaled by `1 / sqrt(rows)`.
pub(crate) fn random_operands(
    shapes: &[Vec<usize>],
    seed: u64,
    dtype: DType,
    weight: impl Fn(usize) -> bool,
) -> Result<Vec<Tensor>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let scale = if weight(i) {
                1.0 / (s[0] as f64).sqrt()
            } else {
                1.0
            };
            Tensor::randn(s.clone(), seed + i as u64, dtype).mul_scalar(scale)
        })
        .collect()
}

/// `made` in f64 as leaves for the host's reference, those where `grads(i)` holds needing a
/// gradient.
pub(crate) fn f64_leaves(made: &[Tensor], grads: impl Fn(usize) -> bool) -> Result<Vec<Tensor>> {
    made.iter()
        .enumerate()
        .map(|(i, t)| Ok(t.to_dtype(DType::F64)?.detach().requires_grad_(grads(i))))
        .collect()
}

/// `made` as global leaves on `pl`: those where `split(i)` holds split by rows, the others
/// broadcast; those where `grads(i)` holds needing a gradient.
pub(crate) fn device_leaves(
    made: &[Tensor],
    pl: &Placement,
    split: impl Fn(usize) -> bool,
    grads: impl Fn(usize) -> bool,
) -> Result<Vec<Tensor>> {
    made.iter()
        .enumerate()
        .map(|(i, t)| {
            let g = t.to_global(pl, vec![Sbp::B])?;
            let g = if split(i) {
                g.to_global(pl, vec![Sbp::S(0)])?
            } else {
                g
            };
            Ok(g.detach().requires_grad_(grads(i)))
        })
        .collect()
}

/// The gradient autograd left on `t`, or a kernel error naming the check `check`.
pub(crate) fn grad_of(t: &Tensor, check: &'static str) -> Result<Tensor> {
    t.grad().ok_or_else(|| oxiflow_tensor::TensorError::Kernel {
        op: check,
        detail: "no gradient".into(),
    })
}

/// Whether every element of `got` is within `tol` times the largest magnitude of `want` (at
/// least 1) of `want`; the first that is not, named `name[i]`, otherwise.
pub(crate) fn within_scale(
    name: &str,
    got: &[f64],
    want: &[f64],
    tol: f64,
) -> std::result::Result<(), String> {
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    match got
        .iter()
        .zip(want)
        .enumerate()
        .find(|(_, (g, w))| (*g - *w).abs() > tol * scale)
    {
        Some((i, (g, w))) => Err(format!("{name}[{i}] {g} vs {w} (scale {scale})")),
        None => Ok(()),
    }
}
