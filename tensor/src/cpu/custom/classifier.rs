//! Fused classifier CPU kernels: the cross-entropy kernels composed into the executor's
//! buffers (16-bit logits reach them widened to f32; padded columns through a narrowed copy).

use crate::cpu::CpuBackend;
use crate::op::custom::{ClassifierKernels, ClassifierOp};
use crate::storage::CpuArray;
use crate::Result;

impl ClassifierKernels for CpuBackend {
    fn classifier(
        &self,
        logits: &CpuArray,
        targets: &CpuArray,
        classes: usize,
        out: [&mut CpuArray; 2],
    ) -> Result<()> {
        ClassifierOp::composed_forward(self, logits, targets, classes, out)
    }
    fn classifier_backward(
        &self,
        dlogits: &CpuArray,
        dloss: &CpuArray,
        out: &mut CpuArray,
    ) -> Result<()> {
        ClassifierOp::composed_backward(self, dlogits, dloss, out)
    }
}
