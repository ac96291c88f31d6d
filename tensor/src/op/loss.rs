//! Per-sample cross-entropy of logits `[N, C]` against i64 labels `[N]`, and its logits gradient.
//! Logits split on the classes take the vocabulary-parallel path, composed of ops that reduce
//! only `[N, 1]` partials, so the logits are never gathered.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, NdSbp, RuleMode, Rules, Sbp, Shape};

use super::gather::{Along, IndexShard};
use super::grad::Grad;
use super::{
    need_float, need_i64, scratch, shape_rule, single, Backend, BinaryOp, Inferred, KernelBackend,
    LocalAt, MetaError, MetaResult, Op, OpFamily, Saves, UnaryOp,
};
use crate::autograd::no_grad;
use crate::dispatch::{dispatch, meta_err};
use crate::tensor::{Tensor, TensorMeta};
use crate::Result;

/// The loss family. Inputs: (logits, labels) -> loss [N]; (logits, labels, dy [N]) -> dlogits.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LossOp {
    CrossEntropy,
    CrossEntropyBackward,
    /// (logits [N, C], labels [N, 1], lse [N, 1]) -> `lse - logits[label]` [N, 1], logits split
    /// on the classes allowed (a P(sum) output: the rank holding class 0 adds lse, every rank
    /// subtracts the target logits it holds); labels must be below `classes` (the columns
    /// from there on are padding); `shard`: this rank's columns (set by `local`).
    VocabParallel {
        shard: IndexShard,
        classes: usize,
    },
    /// (logits, labels [N, 1], lse [N, 1], dy [N, 1]) -> `dy (exp(logits - lse) - onehot)`,
    /// computed on each class shard.
    VocabParallelBackward {
        shard: IndexShard,
    },
}

/// Loss kernels of a backend. Labels out of range are a typed error.
pub trait LossKernels: KernelBackend {
    fn cross_entropy(
        &self,
        logits: &Self::Piece,
        labels: &Self::Piece,
        out: &mut Self::Out,
    ) -> Result<()>;
    fn cross_entropy_backward(
        &self,
        logits: &Self::Piece,
        labels: &Self::Piece,
        dy: &Self::Piece,
        out: &mut Self::Out,
    ) -> Result<()>;
}

impl OpFamily for LossOp {
    fn name(&self) -> &'static str {
        match self {
            LossOp::CrossEntropy => "cross_entropy",
            LossOp::CrossEntropyBackward => "cross_entropy_backward",
            LossOp::VocabParallel { .. } => "vocab_parallel_cross_entropy",
            LossOp::VocabParallelBackward { .. } => "vocab_parallel_cross_entropy_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            LossOp::CrossEntropy => (2, 2),
            LossOp::CrossEntropyBackward | LossOp::VocabParallel { .. } => (3, 3),
            LossOp::VocabParallelBackward { .. } => (4, 4),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        need_float(d[0], "logits")?;
        need_i64(d[1], "labels")?;
        if d[2..].iter().any(|&t| t != d[0]) {
            return Err(MetaError::DType(format!(
                "lse and dy must have the logits' dtype {}, got {:?}",
                d[0],
                &d[2..]
            )));
        }
        let r = match self {
            LossOp::CrossEntropy => rules::cross_entropy(s[0], s[1], mode),
            LossOp::CrossEntropyBackward => {
                if d[2] != d[0] {
                    return Err(MetaError::DType(format!(
                        "dy must have the logits' dtype {}, got {}",
                        d[0], d[2]
                    )));
                }
                rules::cross_entropy_backward(s, mode)
            }
            LossOp::VocabParallel { .. } | LossOp::VocabParallelBackward { .. } => {
                return Ok(Inferred::new(vocab_parallel_rules(s, mode)?, d[0]))
            }
        };
        Ok(Inferred::new(shape_rule(r)?, d[0]))
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        let shard = IndexShard::of_input(at, 0, 1);
        match *self {
            // A label addressing the padding is out of range.
            LossOp::VocabParallel { classes, .. } => Some(LossOp::VocabParallel {
                shard: IndexShard {
                    total: shard.total.min(classes),
                    ..shard
                },
                classes,
            }),
            LossOp::VocabParallelBackward { .. } => Some(LossOp::VocabParallelBackward { shard }),
            _ => None,
        }
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        match *self {
            LossOp::CrossEntropy => b.cross_entropy(x[0], x[1], y),
            LossOp::CrossEntropyBackward => b.cross_entropy_backward(x[0], x[1], x[2], y),
            LossOp::VocabParallel { shard, .. } => {
                let spec = b.out_spec(y);
                let along = Along::per_element(1, shard);
                let target = scratch(b, &spec, |t| b.take(self.name(), x[0], x[1], along, t))?;
                if shard.start == 0 {
                    b.binary(BinaryOp::Sub, x[2], &target, y)
                } else {
                    b.unary(UnaryOp::Neg, &target, y)
                }
            }
            LossOp::VocabParallelBackward { shard } => {
                let spec = b.out_spec(y);
                let d = scratch(b, &spec, |t| b.binary(BinaryOp::Sub, x[0], x[2], t))?;
                let p = scratch(b, &spec, |t| b.unary(UnaryOp::Exp, &d, t))?;
                drop(d);
                let p = scratch(b, &spec, |t| b.binary(BinaryOp::Mul, &p, x[3], t))?;
                let along = Along::per_element(1, shard);
                let onehot = scratch(b, &spec, |t| b.put(self.name(), x[1], x[3], along, t))?;
                b.binary(BinaryOp::Sub, &p, &onehot, y)
            }
        }
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            // Logits and labels (and the vocabulary-parallel path's log-sum-exp).
            LossOp::CrossEntropy => Saves::inputs(&[0, 1]),
            LossOp::VocabParallel { .. } => Saves::inputs(&[0, 1, 2]),
            LossOp::CrossEntropyBackward | LossOp::VocabParallelBackward { .. } => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        match self {
            LossOp::CrossEntropy => Ok(vec![
                g.when(0, || {
                    Tensor::cross_entropy_backward(g.input(0)?, g.input(1)?, g.dy()?)
                })?,
                None,
            ]),
            // lse is the logits' log-sum-exp, so the whole logits gradient is here.
            LossOp::VocabParallel { .. } => {
                let op = LossOp::VocabParallelBackward {
                    shard: IndexShard::default(),
                };
                Ok(vec![
                    g.when(0, || {
                        let dy = to_row_layout(g.dy()?, g.input_meta(0))?;
                        let (x, labels, lse) = (g.input(0)?, g.input(1)?, g.input(2)?);
                        dispatch(op.into(), &[x, labels, lse, &dy])
                    })?,
                    None,
                    None,
                ])
            }
            LossOp::CrossEntropyBackward | LossOp::VocabParallelBackward { .. } => Err(
                Grad::unsupported(self.name(), "higher-order gradients are not supported"),
            ),
        }
    }
}

impl Tensor {
    /// Per-sample cross-entropy of logits `[N, C]` against labels `[N]` (i64) -> `[N]`.
    /// Global logits split on the classes (S(1) on a mesh axis of several ranks) are never
    /// gathered (see [`vocab_parallel_cross_entropy`]); others take the fused kernel.
    pub fn cross_entropy(&self, labels: &Tensor) -> Result<Tensor> {
        if self.ndim() == 2 && classes_split(self) {
            return vocab_parallel_cross_entropy(self, labels, self.shape().dim(1));
        }
        dispatch(LossOp::CrossEntropy.into(), &[self, labels])
    }
    /// [`Tensor::cross_entropy`] over the first `classes` columns of logits `[N, C]`
    /// (`classes` in `1..=C`): the columns from `classes` on are padding (a vocabulary rounded
    /// up to an aligned width), outside the softmax, and their gradient is 0; a label at or
    /// above `classes` is out of range. Classes split over several ranks take the
    /// vocabulary-parallel path with the padding set to -inf on the shards holding it (the
    /// logits stay split); others run on the class columns (a narrowed copy).
    /// `classes == C` is [`Tensor::cross_entropy`].
    pub fn cross_entropy_padded(&self, labels: &Tensor, classes: usize) -> Result<Tensor> {
        let width = match self.shape().dims() {
            [_, c] if (1..=*c).contains(&classes) => *c,
            _ => {
                let op = Op::from(LossOp::CrossEntropy);
                let detail = format!(
                    "needs logits [N, C] with classes {classes} in 1..=C, got {}",
                    self.shape()
                );
                return Err(meta_err(&op, MetaError::Shape(detail), &[self, labels]));
            }
        };
        if classes == width {
            self.cross_entropy(labels)
        } else if classes_split(self) {
            vocab_parallel_cross_entropy(self, labels, classes)
        } else {
            self.narrow(1, 0, classes)?.cross_entropy(labels)
        }
    }
    /// dlogits of the per-sample cross-entropy, given dloss `[N]`.
    pub fn cross_entropy_backward(logits: &Tensor, labels: &Tensor, dy: &Tensor) -> Result<Tensor> {
        dispatch(LossOp::CrossEntropyBackward.into(), &[logits, labels, dy])
    }
}

/// Whether `x` is global with dim 1 split over a mesh axis of several ranks.
fn classes_split(x: &Tensor) -> bool {
    match (x.placement(), x.nd_sbp()) {
        (Some(p), Some(s)) => s
            .iter()
            .zip(p.shape().iter())
            .any(|(a, &n)| a == Sbp::S(1) && n > 1),
        _ => false,
    }
}

/// `[1, C]` of `x`'s dtype: 1 in the columns from `classes` on, 0 before (the upper triangle
/// of ones from diagonal `classes`), laid out as `x [N, C]`'s columns (split where they split,
/// B elsewhere) so masking boxes nothing.
fn padding_mask(x: &Tensor, classes: usize) -> Result<Tensor> {
    let shape = [1, x.shape().dim(1)];
    let ones = match (x.placement(), x.nd_sbp(), x.context()) {
        (Some(p), Some(s), Some(ctx)) => {
            let _g = ctx.install();
            let cols = NdSbp::new(s.iter().map(|a| if a == Sbp::S(1) { a } else { Sbp::B }));
            Tensor::ones_global(shape, x.dtype(), p, cols)?
        }
        _ => Tensor::try_ones(shape, x.dtype())?,
    };
    ones.triu(classes as i64)
}

/// Candidates of the vocabulary-parallel ops, per mesh axis: logits split on the classes with
/// the per-row inputs B -> loss P / dlogits S(1); all split on the rows -> S(0); all B -> B.
fn vocab_parallel_rules(s: &[&Shape], mode: RuleMode) -> MetaResult<Rules> {
    let (x, rows) = (s[0], Shape::from([s[0].dim(0), 1]));
    if x.ndim() != 2 || s[1..].iter().any(|t| **t != rows) {
        return Err(MetaError::Shape(format!(
            "needs logits [N, C] and labels, lse (and dy) [N, 1], got {}",
            s.iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let n = s.len();
    let mut r = Rules::new(mode, [if n == 3 { rows } else { x.clone() }]);
    let mut ins = vec![Sbp::B; n];
    ins[0] = Sbp::S(1);
    r.push(&ins, &[if n == 3 { Sbp::P } else { Sbp::S(1) }]);
    r.push(&vec![Sbp::S(0); n], &[Sbp::S(0)]);
    r.push(&vec![Sbp::B; n], &[Sbp::B]);
    Ok(r)
}

/// Megatron's vocabulary-parallel cross-entropy, for logits split on the classes. Without
/// recording a gradient: per row `m = max` (a P(max) of `[N, 1]`, reduced) and
/// `lse = log(sum(exp(logits - m))) + m` (the sum a P(sum) of `[N, 1]`); then the recorded op
/// `lse - logits[label]`, a P(sum) of `[N, 1]` over the class shards. Only those `[N, 1]`
/// values move between ranks; the backward, `dy (exp(logits - lse) - onehot)`, runs on each
/// shard. With padding (`classes` below C) the logits' padded columns are first set to -inf
/// (a recorded `masked_fill` in their layout), so they add nothing to the sum and get a zero
/// gradient, and labels must be below `classes`.
fn vocab_parallel_cross_entropy(
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
    let (n, width) = (logits.shape().dim(0), logits.shape().dim(1));
    let masked;
    let logits = if classes < width {
        masked = logits.masked_fill(&padding_mask(logits, classes)?, f64::NEG_INFINITY)?;
        &masked
    } else {
        logits
    };
    let lse = {
        let _ng = no_grad();
        let m = logits.max(&[1], true)?;
        let lse = logits.sub(&m)?.exp()?.sum(&[1], true)?.log()?.add(&m)?;
        to_row_layout(&lse, &logits.meta())?
    };
    let shard = IndexShard::default();
    let labels = labels.reshape([n, 1])?;
    dispatch(
        LossOp::VocabParallel { shard, classes }.into(),
        &[logits, &labels, &lse],
    )?
    .reshape([n])
}

/// A per-row tensor `[N, 1]` boxed to the layout that fits the class-split logits `x`: split
/// where `x` splits its rows, B elsewhere (only `[N, 1]` values move), so the vocabulary-parallel
/// ops never box the logits, whatever the sizes.
fn to_row_layout(t: &Tensor, x: &TensorMeta) -> Result<Tensor> {
    let (Some(p), Some(s)) = (x.placement(), x.nd_sbp()) else {
        return Ok(t.clone());
    };
    let rows = NdSbp::new(s.iter().map(|a| if a == Sbp::S(0) { a } else { Sbp::B }));
    t.to_global(p, rows)
}
