//! The `Tensor` methods of the custom op `op/custom/linear.rs`: they build its
//! ops and dispatch them.

use oxiflow_dtype::MatmulPrecision;

use crate::dispatch::dispatch_multi;
use crate::op::custom::{Activation, LinearOp};
use crate::op::kernel_err;
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// `act(self w + bias)` for self `[.., K]`, w `[K, N]`, bias `[N]`, in one op (on CUDA one
    /// cuBLASLt product with the bias and GELU in its epilogue).
    pub fn linear(&self, w: &Tensor, bias: Option<&Tensor>, act: Activation) -> Result<Tensor> {
        self.linear_at(w, bias, act, MatmulPrecision::F32)
    }
    /// [`Tensor::linear`] with f32 products at `precision` on a device (forward and backward).
    pub fn linear_at(
        &self,
        w: &Tensor,
        bias: Option<&Tensor>,
        act: Activation,
        precision: MatmulPrecision,
    ) -> Result<Tensor> {
        let mut ins = vec![self, w];
        ins.extend(bias);
        let out = dispatch_multi(LinearOp::Forward { act, precision }.into(), &ins)?;
        out.into_iter()
            .next()
            .ok_or_else(|| kernel_err("linear", "gave no output".into()))
    }
}
