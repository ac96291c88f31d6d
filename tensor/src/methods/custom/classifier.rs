//! The `Tensor` methods of the custom op `op/custom/classifier.rs`: they build its
//! ops and dispatch them.

use oxiflow_sbp::RuleMode;

use crate::dispatch::dispatch_multi;
use crate::methods::loss::{classes_split, vocab_parallel_cross_entropy};
use crate::op::custom::ClassifierOp;
use crate::op::{kernel_err, meta_err, OpFamily};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Per-row cross-entropy of logits `[N, V]` against targets `[N]` (i64) -> `[N]` (f32; f64
    /// for f64 logits), through the fused classifier: the logits' gradient is computed in the
    /// forward and kept in their dtype, the logits are not. Logits split on the classes over
    /// several ranks take the vocabulary-parallel cross-entropy instead (the same loss in the
    /// same dtype; the logits stay split and are kept for the backward, in their dtype).
    pub fn classifier_loss(&self, targets: &Tensor) -> Result<Tensor> {
        let classes = match self.shape().dims() {
            [_, v] => *v,
            // Not [N, V]: `infer` names the shapes.
            _ => 1,
        };
        self.classifier_loss_padded(targets, classes)
    }

    /// [`Tensor::classifier_loss`] over the first `classes` columns of logits `[N, V]` (`classes`
    /// in `1..=V`): the columns from `classes` on are padding (a vocabulary rounded up to an
    /// aligned width), outside the softmax, and their gradient is 0; targets must be below
    /// `classes`. `classes == V` is [`Tensor::classifier_loss`].
    pub fn classifier_loss_padded(&self, targets: &Tensor, classes: usize) -> Result<Tensor> {
        let op = ClassifierOp::Forward { classes };
        if classes_split(self) {
            // The fused op's checks first, so every layout refuses bad input alike.
            let shapes = [self.shape(), targets.shape()];
            op.infer(
                &shapes,
                &[self.dtype(), targets.dtype()],
                RuleMode::ShapesOnly,
            )
            .map_err(|e| meta_err(&op.into(), e, &[self, targets]))?;
            return vocab_parallel_cross_entropy(self, targets, classes);
        }
        let out = dispatch_multi(op.into(), &[self, targets])?;
        out.into_iter()
            .next()
            .ok_or_else(|| kernel_err("classifier", "gave no output".into()))
    }
}
