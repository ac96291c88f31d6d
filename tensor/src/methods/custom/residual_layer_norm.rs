//! The `Tensor` methods of the custom op `op/custom/residual_layer_norm.rs`: they build its
//! ops and dispatch them.

use crate::dispatch::dispatch_multi;
use crate::op::custom::ResidualLayerNorm;
use crate::op::{kernel_err, F64Bits, OpFamily};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// The gradients (dx, dweight, dbias) of a layer norm over the last dim of `x` from `dy`,
    /// the rows' `mean` and `rstd` saved by the forward, with `dr` (a gradient `x` has from its
    /// other consumers, such as a residual stream's) added to dx: one kernel. dweight and dbias
    /// are each rank's part, rounded once to the weight's dtype (a partial sum over split rows
    /// stays partial).
    pub(crate) fn layer_norm_grads(
        x: &Tensor,
        weight: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        dr: Option<&Tensor>,
    ) -> Result<[Tensor; 3]> {
        let mut ins = vec![x, weight, mean, rstd, dy];
        ins.extend(dr);
        let op = ResidualLayerNorm::Backward;
        let out = dispatch_multi(op.into(), &ins)?;
        <[Tensor; 3]>::try_from(out)
            .map_err(|v| kernel_err(op.name(), format!("gave {} outputs, not 3", v.len())))
    }

    /// `r = self + a` and `y = LayerNorm(r)` over the last dim (weight and bias `[H]`) in one
    /// op: returns (r, y); both carry gradients, and the backward computes the residual
    /// stream's gradient `dr + LN'(dy)` in one pass.
    pub fn residual_layer_norm(
        &self,
        a: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        let (r, y, _, _) = self.residual_layer_norm_stats(a, weight, bias, eps)?;
        Ok((r, y))
    }
    /// [`Tensor::residual_layer_norm`] with the per-row statistics: (r, y, mean, rstd), mean
    /// and rstd `[.., 1]` (f32 for 16-bit data; no gradient).
    pub fn residual_layer_norm_stats(
        &self,
        a: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let op = ResidualLayerNorm::Forward {
            eps: F64Bits::new(eps),
        };
        let out = dispatch_multi(op.into(), &[self, a, weight, bias])?;
        match <[Tensor; 4]>::try_from(out) {
            Ok([r, y, mean, rstd]) => Ok((r, y, mean, rstd)),
            Err(v) => Err(kernel_err(
                op.name(),
                format!("gave {} outputs, not 4", v.len()),
            )),
        }
    }
}
