//! The layer norm's whole backward ([`NormOp::LayerNormGrads`](super::NormOp)) composed of
//! the core families' kernels: every backend's where no fused kernel serves the call.

use super::kernels::CoreKernels;
use super::{scratch, BinaryOp, KernelBackend, OutSpec};
use crate::Result;

/// [`NormOp::LayerNormGrads`](super::NormOp) composed of kernels (every backend's where no fused kernel
/// serves the call): LayerNorm's input gradient plus `dr`, and the weight and
/// bias gradients as sums over the rows of `dy xhat` and `dy` (the statistics cast to the
/// data's dtype where they differ).
pub fn composed_layer_norm_grads<B>(
    b: &B,
    [r, w, mean, rstd, dy]: [&B::Piece; 5],
    dr: Option<&B::Piece>,
    [dx, dw, db]: [&mut B::Out; 3],
) -> Result<()>
where
    B: CoreKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
{
    let data = b.out_spec(r);
    match dr {
        Some(dr) => {
            let t = scratch(b, &data, |t| b.layer_norm_backward(r, w, dy, mean, rstd, t))?;
            b.binary(BinaryOp::Add, &t, dr, dx)?;
        }
        None => b.layer_norm_backward(r, w, dy, mean, rstd, dx)?,
    }
    // The weight gradient's terms and their sum over rows in the statistics' dtype (f32
    // for 16-bit data, as the device kernel accumulates), rounded once to dw's dtype.
    let stats = b.out_spec(mean).dtype;
    let in_stats = |s: &B::Piece| -> Result<Option<B::Piece>> {
        let spec = b.out_spec(s);
        if spec.dtype == stats {
            return Ok(None);
        }
        let spec = OutSpec {
            dtype: stats,
            ..spec
        };
        scratch(b, &spec, |t| b.cast(s, t)).map(Some)
    };
    let (r2, dy2) = (in_stats(r)?, in_stats(dy)?);
    let (rs, dys) = (r2.as_ref().unwrap_or(r), dy2.as_ref().unwrap_or(dy));
    let wide = OutSpec {
        dtype: stats,
        ..data.clone()
    };
    let centred = scratch(b, &wide, |t| b.binary(BinaryOp::Sub, rs, mean, t))?;
    drop(r2);
    let xhat = scratch(b, &wide, |t| b.binary(BinaryOp::Mul, &centred, rstd, t))?;
    drop(centred);
    let prod = scratch(b, &wide, |t| b.binary(BinaryOp::Mul, &xhat, dys, t))?;
    drop((xhat, dy2));
    let dw_spec = b.out_spec(dw);
    if dw_spec.dtype == stats {
        b.sum_to_shape(&prod, dw)?;
    } else {
        let sum = scratch(
            b,
            &OutSpec {
                dtype: stats,
                ..dw_spec
            },
            |t| b.sum_to_shape(&prod, t),
        )?;
        b.cast(&sum, dw)?;
    }
    b.sum_to_shape(dy, db)
}
