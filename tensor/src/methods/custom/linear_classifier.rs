//! The `Tensor` methods of the custom op `op/custom/linear_classifier.rs`: they build its
//! ops and dispatch them.

use oxiflow_dtype::MatmulPrecision;
use oxiflow_sbp::{RuleMode, Sbp};

use crate::dispatch::dispatch_multi;
use crate::grad_mode::is_grad_enabled;
use crate::op::custom::LinearClassifier;
use crate::op::{kernel_err, meta_err, OpFamily};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// The sum over rows of the cross-entropy of `self w^T` (self `[N, C]`, table `w`
    /// `[V, C]`, targets `[N]` i64) over its first `classes` columns (`classes` in `1..=V`;
    /// the rest are padding, outside the softmax): a 0-d tensor in the loss dtype of
    /// [`Tensor::classifier_loss`]. Where a gradient is wanted it runs as one fused op
    /// ([`LinearClassifier`]) that never keeps the logits; a table split on the classes takes
    /// the vocabulary-parallel cross-entropy, and a call that wants no gradient the product
    /// and the fused classifier.
    pub fn linear_classifier_loss_sum(
        &self,
        w: &Tensor,
        targets: &Tensor,
        classes: usize,
    ) -> Result<Tensor> {
        self.linear_classifier_loss_sum_at(w, targets, classes, MatmulPrecision::F32)
    }
    /// [`Tensor::linear_classifier_loss_sum`] with f32 products at `precision` on a device.
    pub fn linear_classifier_loss_sum_at(
        &self,
        w: &Tensor,
        targets: &Tensor,
        classes: usize,
        precision: MatmulPrecision,
    ) -> Result<Tensor> {
        let op = LinearClassifier::Forward { classes, precision };
        // The fused op's checks first, so every path refuses bad input alike.
        let shapes = [self.shape(), w.shape(), targets.shape()];
        op.infer(
            &shapes,
            &[self.dtype(), w.dtype(), targets.dtype()],
            RuleMode::ShapesOnly,
        )
        .map_err(|e| meta_err(&op.into(), e, &[self, w, targets]))?;
        let wants_grad = is_grad_enabled() && (self.requires_grad() || w.requires_grad());
        // The fused op's layouts: rows split or whole, the table whole; others would box.
        let fused = wants_grad
            && !w.has_sbp_over_ranks(|s| s != Sbp::Broadcast)
            && !self.has_sbp_over_ranks(|s| s != Sbp::S(0) && s != Sbp::Broadcast);
        if !fused {
            return self
                .matmul_t_at(w, (false, true), precision)?
                .classifier_loss_padded(targets, classes)?
                .sum_all();
        }
        let out = dispatch_multi(op.into(), &[self, w, targets])?;
        out.into_iter()
            .next()
            .ok_or_else(|| kernel_err("linear_classifier", "gave no output".into()))
    }
}
