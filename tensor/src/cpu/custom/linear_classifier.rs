//! Fused linear cross-entropy CPU kernels: the product, classifier, product and sum kernels
//! composed over all rows into the executor's buffers; the backward a broadcasting product.

use oxiflow_dtype::MatmulPrecision;

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
        precision: MatmulPrecision,
        out: [&mut CpuArray; 3],
    ) -> Result<()> {
        LinearClassifier::composed(self, x, w, targets, (classes, precision), out)
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
