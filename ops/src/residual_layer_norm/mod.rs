//! Residual add + LayerNorm over the last dim, fused: (x, a, weight [H], bias [H]) -> (r = x + a,
//! y = LayerNorm(r), mean, rstd), r and y differentiable, the per-row statistics saved for the
//! backward (not differentiable); the backward is the core layer norm's whole backward
//! (`Tensor::layer_norm_grads`), which turns (dr, dy) into the residual stream's gradient
//! `dr + LN'(dy)` in one pass, with the weight and bias gradients.
//!
//! Layouts: `oxiflow_sbp::rules::residual_layer_norm` (rows split or whole, the parameters
//! broadcast). Kernels: CPU in f32 and f64 (16-bit data through f32, rounded once), the add and
//! LayerNorm kernels composed; CUDA in f32, f64, bf16 and f16, the library's one-pass fused
//! forward where it serves the call, else composed.

mod cpu;
mod cuda;

use std::sync::LazyLock;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::backend::{kernel_err, norm_stats_dtype, ElementwiseKernels, NormKernels};
use oxiflow_tensor::{
    dispatch_multi, BinaryOp, Extern, ExternOp, F64Bits, Grad, Inferred, KernelBackend, Kernels,
    MetaError, MetaResult, Result, Saves, Tensor,
};

use crate::op_signature::op_signature;
use crate::operand_dtypes::{kernels_for, one_float_dtype};

/// The fused residual LayerNorm with its epsilon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResidualLayerNorm {
    pub eps: F64Bits,
}

/// `r = x + a` and `y = LayerNorm(r)` over the last dim (weight and bias `[H]`) in one op:
/// returns (r, y); both carry gradients, and the backward computes the residual stream's
/// gradient `dr + LN'(dy)` in one pass.
pub fn residual_layer_norm(
    x: &Tensor,
    a: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (r, y, _, _) = residual_layer_norm_stats(x, a, weight, bias, eps)?;
    Ok((r, y))
}

/// [`residual_layer_norm`] with the per-row statistics: (r, y, mean, rstd), mean and rstd
/// `[.., 1]` (f32 for 16-bit data; no gradient).
pub fn residual_layer_norm_stats(
    x: &Tensor,
    a: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let op = ResidualLayerNorm {
        eps: F64Bits::new(eps),
    };
    let out = dispatch_multi(Extern::new(op).into(), &[x, a, weight, bias])?;
    match <[Tensor; 4]>::try_from(out) {
        Ok([r, y, mean, rstd]) => Ok((r, y, mean, rstd)),
        Err(v) => Err(kernel_err(
            "residual_layer_norm",
            format!("gave {} outputs, not 4", v.len()),
        )),
    }
}

/// The dtypes of the kernels, on the CPU (16-bit data through f32) and on CUDA.
const DTYPES: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16];

static KERNELS: LazyLock<Kernels> =
    LazyLock::new(|| kernels_for::<ResidualLayerNorm>(DTYPES, cpu::forward, cuda::forward));

/// The forward composed of the add and LayerNorm kernels (the CPU's kernel, and the device's
/// where its fused kernel does not serve the call).
fn composed<B>(
    b: &B,
    [x, a, w, bias]: [&B::Piece; 4],
    eps: f64,
    [r, y, mean, rstd]: [&mut B::Out; 4],
) -> Result<()>
where
    B: ElementwiseKernels + NormKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
{
    b.binary(BinaryOp::Add, x, a, r)?;
    b.layer_norm(r, w, bias, eps, y, mean, rstd)
}

impl ExternOp for ResidualLayerNorm {
    op_signature!("residual_layer_norm", 4);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&self.eps.get().to_bits().to_le_bytes());
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = one_float_dtype(d)?;
        if s[1] != s[0] {
            return Err(MetaError::Shape(format!(
                "the residual branch must be {}, got {}",
                s[0], s[1]
            )));
        }
        // The plain norm's rules check the shapes and give (y, mean, rstd).
        let ln = rules::layer_norm(1, &[s[0], s[2], s[3]], mode).map_err(MetaError::Shape)?;
        let r = rules::residual_layer_norm(s[0], &ln.out_shapes()[1], mode);
        let st = norm_stats_dtype(dt);
        Ok(Inferred::outputs(r, &[dt, dt, st, st]))
    }
    fn kernels(&self) -> &Kernels {
        &KERNELS
    }
    fn differentiable(&self, output: usize) -> bool {
        // r and y; the statistics are saved for the backward.
        output < 2
    }
    fn saves(&self, _needs: &[bool]) -> Saves {
        // The sum r, the weight and the statistics.
        Saves::inputs(&[2]).and_outputs(&[0, 2, 3])
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let dys = g.dys();
        let (dr, dy) = (
            dys.first().and_then(Option::as_ref),
            dys.get(1).and_then(Option::as_ref),
        );
        let (dx, dw, db) = match dy {
            Some(dy) => {
                let (r, w) = (g.output(0)?, g.input(2)?);
                let (mean, rstd) = (g.output(2)?, g.output(3)?);
                let [dx, dw, db] = Tensor::layer_norm_grads(r, w, mean, rstd, dy, dr)?;
                (Some(dx), Some(dw), Some(db))
            }
            // Only the sum has a gradient: it passes to both summands.
            None => (dr.cloned(), None, None),
        };
        let keep = |i: usize, t: Option<Tensor>| if g.need(i) { t } else { None };
        Ok(vec![
            keep(0, dx.clone()),
            keep(1, dx),
            keep(2, dw),
            keep(3, db),
        ])
    }
}
