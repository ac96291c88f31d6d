//! The `Tensor` methods of the custom op `op/custom/residual_mlp.rs`: they build its
//! ops and dispatch them.

use oxiflow_dtype::MatmulPrecision;

use crate::dispatch::dispatch_multi;
use crate::op::custom::ResidualMlp;
use crate::op::kernel_err;
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// `residual + gelu(self w_fc + b_fc) w_proj + b_proj` for self `[.., C]`, w_fc `[C, F]`,
    /// b_fc `[F]`, w_proj `[F, C]`, b_proj `[C]` and residual like self, as one op (see
    /// [`ResidualMlp`]). Weights split over ranks are gathered by the op's layouts: a
    /// tensor-parallel MLP composes its linear layers instead.
    pub fn residual_mlp(
        &self,
        w_fc: &Tensor,
        b_fc: &Tensor,
        w_proj: &Tensor,
        b_proj: &Tensor,
        residual: &Tensor,
    ) -> Result<Tensor> {
        let f32 = MatmulPrecision::F32;
        self.residual_mlp_with(w_fc, b_fc, w_proj, b_proj, residual, (false, f32))
    }

    /// [`Tensor::residual_mlp`] keeping only the pre-activation for the backward when
    /// `recompute_hidden` (which computes GELU's output again from it): one `[.., F]` tensor
    /// less kept, one element-wise pass more; its f32 products at `precision` on a device.
    pub fn residual_mlp_with(
        &self,
        w_fc: &Tensor,
        b_fc: &Tensor,
        w_proj: &Tensor,
        b_proj: &Tensor,
        residual: &Tensor,
        (recompute_hidden, precision): (bool, MatmulPrecision),
    ) -> Result<Tensor> {
        let ins = [self, w_fc, b_fc, w_proj, b_proj, residual];
        let op = ResidualMlp::Forward {
            recompute_hidden,
            precision,
        };
        dispatch_multi(op.into(), &ins)?
            .into_iter()
            .next()
            .ok_or_else(|| kernel_err("residual_mlp", "gave no output".into()))
    }
}
