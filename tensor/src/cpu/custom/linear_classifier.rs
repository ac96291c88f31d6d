//! Fused linear cross-entropy CPU kernels: the product, classifier, product and sum kernels
//! composed over all rows into the executor's buffers; the backward a broadcasting product.

use crate::cpu::CpuBackend;
use crate::op::custom::{LinearClassifier, LinearClassifierKernels};
use crate::storage::CpuArray;
use crate::Result;

impl LinearClassifierKernels for CpuBackend {
    fn linear_classifier(
        &self,
        x: &CpuArray,
        w: &CpuArray,
        targets: &CpuArray,
        classes: usize,
        out: [&mut CpuArray; 3],
    ) -> Result<()> {
        LinearClassifier::composed(self, x, w, targets, classes, out)
    }
    fn linear_classifier_backward(
        &self,
        saved: [&CpuArray; 2],
        dloss: &CpuArray,
        out: [&mut CpuArray; 2],
    ) -> Result<()> {
        LinearClassifier::composed_backward(self, saved, dloss, out)
    }
}
