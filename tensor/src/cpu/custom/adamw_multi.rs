//! Multi-tensor AdamW CPU kernel: each tensor's three fused AdamW passes, into the executor's
//! buffers (a clip ratio operand folded into the coefficients first; a NaN one of a
//! `skip_nan` op leaves every tensor as it was).

use crate::cpu::CpuBackend;
use crate::op::custom::{AdamWMulti, AdamWMultiKernels};
use crate::op::kernel_err;
use crate::storage::CpuArray;
use crate::Result;

impl AdamWMultiKernels for CpuBackend {
    fn adamw_multi(&self, op: &AdamWMulti, x: &[&CpuArray], out: &mut [CpuArray]) -> Result<()> {
        let n = op.decay.len();
        if !op.clipped {
            return op.composed(self, 0..n, x, out, false);
        }
        let r = x
            .get(4 * n)
            .and_then(|s| s.as_array::<f64>())
            .and_then(|a| a.iter().next().copied())
            .ok_or_else(|| kernel_err("adamw_multi", "no f64 clip ratio".into()))?;
        op.with_scale(AdamWMulti::ratio_scale(r)).composed(
            self,
            0..n,
            &x[..4 * n],
            out,
            op.keeps_all(r),
        )
    }
}
