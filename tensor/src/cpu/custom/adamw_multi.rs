//! Multi-tensor AdamW CPU kernel: each tensor's three fused AdamW passes, into the executor's
//! buffers.

use crate::cpu::CpuBackend;
use crate::op::custom::{AdamWMulti, AdamWMultiKernels};
use crate::storage::CpuArray;
use crate::Result;

impl AdamWMultiKernels for CpuBackend {
    fn adamw_multi(&self, op: &AdamWMulti, x: &[&CpuArray], out: &mut [CpuArray]) -> Result<()> {
        op.composed(self, 0..op.decay.len(), x, out)
    }
}
