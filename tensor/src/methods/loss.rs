//! The `Tensor` methods of the loss family (`op/loss.rs`): they build its ops
//! and dispatch them.

use oxiflow_dtype::DType;
use oxiflow_sbp::{NdSbp, RuleMode, Sbp};

use crate::dispatch::dispatch;
use crate::grad_mode::no_grad;
use crate::op::{meta_err, to_row_layout, ClassShard, LossOp, MetaError, Op, OpFamily};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Per-sample cross-entropy of logits `[N, C]` against labels `[N]` (i64) -> `[N]`.
    /// Global logits split on the classes (S(1) on a mesh axis of several ranks) are never
    /// gathered (see [`vocab_parallel_cross_entropy`]); others take the fused kernel.
    pub fn cross_entropy(&self, labels: &Tensor) -> Result<Tensor> {
        if self.ndim() == 2 && classes_split(self) {
            let loss = vocab_parallel_cross_entropy(self, labels, self.shape().dim(1))?;
            return in_dtype(loss, self.dtype());
        }
        dispatch(LossOp::CrossEntropy.into(), &[self, labels])
    }
    /// [`Tensor::cross_entropy`] over the first `classes` columns of logits `[N, C]`
    /// (`classes` in `1..=C`): the columns from `classes` on are padding (a vocabulary rounded
    /// up to an aligned width), outside the softmax, and their gradient is 0; a label at or
    /// above `classes` is out of range. Classes split over several ranks take the
    /// vocabulary-parallel path, whose kernels skip the padding (the logits stay split and
    /// are not copied); others run on the class columns (a narrowed copy).
    /// `classes == C` is [`Tensor::cross_entropy`].
    pub fn cross_entropy_padded(&self, labels: &Tensor, classes: usize) -> Result<Tensor> {
        let width = padded_width(self, labels, classes, &LossOp::CrossEntropy.into())?;
        if classes == width {
            self.cross_entropy(labels)
        } else if classes_split(self) {
            let loss = vocab_parallel_cross_entropy(self, labels, classes)?;
            in_dtype(loss, self.dtype())
        } else {
            self.narrow(1, 0, classes)?.cross_entropy(labels)
        }
    }
    /// dlogits of the per-sample cross-entropy, given dloss `[N]`.
    pub fn cross_entropy_backward(logits: &Tensor, labels: &Tensor, dy: &Tensor) -> Result<Tensor> {
        dispatch(LossOp::CrossEntropyBackward.into(), &[logits, labels, dy])
    }
}

/// The width `C` of logits `[N, C]` when `classes` is in `1..=C`; else a shape error of `op`.
pub(crate) fn padded_width(x: &Tensor, labels: &Tensor, classes: usize, op: &Op) -> Result<usize> {
    match x.shape().dims() {
        [_, c] if (1..=*c).contains(&classes) => Ok(*c),
        _ => {
            let detail = format!(
                "needs logits [N, C] with classes {classes} in 1..=C, got {}",
                x.shape()
            );
            Err(meta_err(op, MetaError::Shape(detail), &[x, labels]))
        }
    }
}

/// `loss` in `dtype` (the vocabulary-parallel path computes 16-bit logits' loss in f32).
fn in_dtype(loss: Tensor, dtype: DType) -> Result<Tensor> {
    if loss.dtype() == dtype {
        Ok(loss)
    } else {
        loss.to_dtype(dtype)
    }
}

/// Whether `x` is global with dim 1 split over a mesh axis of several ranks.
pub(crate) fn classes_split(x: &Tensor) -> bool {
    x.has_sbp_over_ranks(|s| s == Sbp::S(1))
}

/// Megatron's vocabulary-parallel cross-entropy over the first `classes` columns of logits
/// `[N, C]` split on the classes -> loss `[N]` in the logits' compute dtype (f32 for 16-bit
/// logits, which are read as they are: no f32 copy). Without recording a gradient: one fused
/// pass per class shard gives each shard's log-sum-exp of its class columns (`[N, shards]`,
/// one column per rank); their max `m` (a P(max) of `[N, 1]`, reduced) and
/// `lse = log(sum(exp(partials - m))) + m` (the sum a P(sum) of `[N, 1]`) combine them. Then
/// the recorded op `lse - logits[label]`, a P(sum) of `[N, 1]` over the class shards, which
/// keeps the logits for its backward, `dy (exp(logits - lse) - onehot)` on each shard (0 in
/// the padding). Only `[N, 1]` and `[N, shards]` values move between ranks, and no kernel
/// makes a temporary of the logits' size. Partial logits are first reduced onto class shards.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
    classes: usize,
) -> Result<Tensor> {
    let op = LossOp::CrossEntropy;
    let shapes = [logits.shape(), labels.shape()];
    op.infer(
        &shapes,
        &[logits.dtype(), labels.dtype()],
        RuleMode::ShapesOnly,
    )
    .map_err(|e| meta_err(&Op::from(op.clone()), e, &[logits, labels]))?;
    padded_width(logits, labels, classes, &Op::from(op))?;
    let logits = &without_partials(logits)?;
    let n = logits.shape().dim(0);
    let meta = logits.meta();
    let at = ClassShard { start: 0, classes };
    let lse = {
        let _ng = no_grad();
        let parts = LossOp::VocabParallelLse {
            at,
            parts: class_shards(logits),
        };
        let partials = dispatch(parts.into(), &[logits])?;
        let m = to_row_layout(&partials.max(&[1], true)?, &meta)?;
        let sum = partials.sub(&m)?.exp()?.sum(&[1], true)?;
        to_row_layout(&sum.log()?.add(&m)?, &meta)?
    };
    let labels = labels.reshape([n, 1])?;
    dispatch(
        LossOp::VocabParallel { at }.into(),
        &[logits, &labels, &lse],
    )?
    .reshape([n])
}

/// `x` with every partial mesh axis reduced onto a split of the classes (S(1)), so each rank
/// holds whole values of its class shard.
fn without_partials(x: &Tensor) -> Result<Tensor> {
    let partial = |a: Sbp| matches!(a, Sbp::Partial(_));
    match (x.placement(), x.nd_sbp()) {
        (Some(p), Some(s)) if s.iter().any(partial) => {
            let nd = NdSbp::new(s.iter().map(|a| if partial(a) { Sbp::S(1) } else { a }));
            x.to_global(p, nd)
        }
        _ => Ok(x.clone()),
    }
}

/// How many class shards the layout of `x` `[N, C]` cuts: the product of the mesh axes that
/// split dim 1 (1 for a local tensor).
fn class_shards(x: &Tensor) -> usize {
    match (x.placement(), x.nd_sbp()) {
        (Some(p), Some(s)) => s
            .iter()
            .zip(p.shape().iter())
            .filter(|(a, _)| *a == Sbp::S(1))
            .map(|(_, &n)| n)
            .product(),
        _ => 1,
    }
}
