//! The `Tensor` methods of the norm family (`op/norm.rs`): they build its ops
//! and dispatch them.

use crate::dispatch::{dispatch, dispatch_multi};
use crate::grad_mode::no_grad;
use crate::op::{kernel_err, F64Bits, NormOp};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Layer norm over the last dim with weight and bias `[H]`.
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        Ok(self.layer_norm_stats(weight, bias, eps)?.0)
    }
    /// Layer norm over the last dim with its per-row statistics: (y, mean, rstd), mean and
    /// rstd `[.., 1]` (only y carries a gradient).
    pub fn layer_norm_stats(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let eps = F64Bits::new(eps);
        let out = dispatch_multi(NormOp::LayerNorm { eps }.into(), &[self, weight, bias])?;
        match <[Tensor; 3]>::try_from(out) {
            Ok([y, mean, rstd]) => Ok((y, mean, rstd)),
            Err(v) => Err(kernel_err(
                "layer_norm",
                format!("gave {} outputs, not 3", v.len()),
            )),
        }
    }
    /// dx of layer norm over the last dim (the statistics computed from x here).
    pub fn layer_norm_backward(
        x: &Tensor,
        weight: &Tensor,
        dy: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        let (mean, rstd) = {
            let _ng = no_grad();
            let zeros = weight.mul_scalar(0.0)?;
            let (_, mean, rstd) = x.layer_norm_stats(weight, &zeros, eps)?;
            (mean, rstd)
        };
        Tensor::layer_norm_backward_from(x, weight, dy, &mean, &rstd)
    }
    /// dx of layer norm over the last dim from the forward's per-row mean and rstd.
    pub fn layer_norm_backward_from(
        x: &Tensor,
        weight: &Tensor,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
    ) -> Result<Tensor> {
        dispatch(
            NormOp::LayerNormBackward.into(),
            &[x, weight, dy, mean, rstd],
        )
    }

    /// The gradients (dx, dweight, dbias) of a layer norm over the last dim of `x` from `dy`,
    /// the rows' `mean` and `rstd` saved by the forward, with `dr` (a gradient `x` has from its
    /// other consumers, such as a residual stream's) added to dx: one kernel. dweight and dbias
    /// are each rank's part, rounded once to the weight's dtype (a partial sum over split rows
    /// stays partial).
    pub fn layer_norm_grads(
        x: &Tensor,
        weight: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        dr: Option<&Tensor>,
    ) -> Result<[Tensor; 3]> {
        let mut ins = vec![x, weight, mean, rstd, dy];
        ins.extend(dr);
        let out = dispatch_multi(NormOp::LayerNormGrads.into(), &ins)?;
        <[Tensor; 3]>::try_from(out).map_err(|v| {
            kernel_err(
                "residual_layer_norm_backward",
                format!("gave {} outputs, not 3", v.len()),
            )
        })
    }
}
