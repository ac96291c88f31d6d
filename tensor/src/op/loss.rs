//! Per-sample cross-entropy of logits `[N, C]` against i64 labels `[N]`, and its logits gradient.
//! Logits split on the classes take the vocabulary-parallel path: one fused pass per class shard
//! gives each shard's log-sum-exp, and only per-row partials move between ranks, so the logits
//! are never gathered, copied or masked.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, NdSbp, RuleMode, Rules, Sbp, Shape};

use super::grad::Grad;
use super::{
    need_float, need_i64, shape_rule, single, Backend, Inferred, KernelBackend, LocalAt, MetaError,
    MetaResult, Op, OpFamily, Saves,
};
use crate::dispatch::{dispatch, meta_err};
use crate::grad_mode::no_grad;
use crate::tensor::{Tensor, TensorMeta};
use crate::Result;

/// Where a rank's logits piece sits among the classes: the global index of its first column
/// and the number of classes (global columns from `classes` on are padding: outside the
/// softmax, gradient 0). The global op holds `start` 0; `OpFamily::local` sets the rank's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClassShard {
    pub start: usize,
    pub classes: usize,
}

impl ClassShard {
    /// How many of a piece's `width` columns are classes (the rest are padding).
    pub fn class_columns(self, width: usize) -> usize {
        self.classes.saturating_sub(self.start).min(width)
    }
}

/// The loss family. Inputs: (logits, labels) -> loss [N]; (logits, labels, dy [N]) -> dlogits.
/// The vocabulary-parallel ops compute in the logits' compute dtype (f32 for 16-bit logits):
/// their log-sum-exp, loss and incoming gradient have that dtype, their logits gradient the
/// logits' own.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LossOp {
    CrossEntropy,
    CrossEntropyBackward,
    /// (logits [N, C]) -> `[N, parts]`, not differentiable: column k is the log-sum-exp of the
    /// row's classes (columns below `at.classes`) that the k-th class shard of the logits'
    /// layout holds (-inf where it holds none), computed in one pass over the shard. Built by
    /// the vocabulary-parallel cross-entropy with `parts` the number of class shards, so the
    /// output splits where the logits split their classes and each rank writes one column.
    VocabParallelLse {
        at: ClassShard,
        parts: usize,
    },
    /// (logits [N, C], labels [N, 1], lse [N, 1]) -> `lse - logits[label]` [N, 1], logits split
    /// on the classes allowed (a P(sum) output: the rank holding class 0 adds lse, every rank
    /// subtracts the target logits it holds); labels must be below `at.classes`.
    VocabParallel {
        at: ClassShard,
    },
    /// (logits, labels [N, 1], lse [N, 1], dy [N, 1]) -> `dy (exp(logits - lse) - onehot)` in
    /// the class columns and 0 in the padding, computed on each class shard in one pass.
    VocabParallelBackward {
        at: ClassShard,
    },
}

/// Loss kernels of a backend. Labels out of range are a typed error (NaN rows on devices,
/// which cannot raise one without a synchronisation).
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
    /// `out` `[rows, 1]` (compute dtype): per row of `logits` `[rows, width]`, the log-sum-exp
    /// of its class columns (`at.class_columns(width)`), -inf where there are none; one pass
    /// (a running max and the sum of exponentials relative to it), no temporary of the
    /// logits' size.
    fn vocab_parallel_lse(
        &self,
        logits: &Self::Piece,
        at: ClassShard,
        out: &mut Self::Out,
    ) -> Result<()>;
    /// `out` `[rows, 1]` (compute dtype): `lse` where `at.start` is 0 (else 0), minus the
    /// row's label logit where this piece holds its column.
    fn vocab_parallel_loss(
        &self,
        logits: &Self::Piece,
        labels: &Self::Piece,
        lse: &Self::Piece,
        at: ClassShard,
        out: &mut Self::Out,
    ) -> Result<()>;
    /// `out` of the logits' shape and dtype: `dy (exp(logits - lse) - onehot(label))` in the
    /// class columns, exactly 0 in the padding columns.
    fn vocab_parallel_backward(
        &self,
        logits: &Self::Piece,
        labels: &Self::Piece,
        lse: &Self::Piece,
        dy: &Self::Piece,
        at: ClassShard,
        out: &mut Self::Out,
    ) -> Result<()>;
}

impl OpFamily for LossOp {
    fn name(&self) -> &'static str {
        match self {
            LossOp::CrossEntropy => "cross_entropy",
            LossOp::CrossEntropyBackward => "cross_entropy_backward",
            LossOp::VocabParallelLse { .. } => "vocab_parallel_log_sum_exp",
            LossOp::VocabParallel { .. } => "vocab_parallel_cross_entropy",
            LossOp::VocabParallelBackward { .. } => "vocab_parallel_cross_entropy_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            LossOp::VocabParallelLse { .. } => (1, 1),
            LossOp::CrossEntropy => (2, 2),
            LossOp::CrossEntropyBackward | LossOp::VocabParallel { .. } => (3, 3),
            LossOp::VocabParallelBackward { .. } => (4, 4),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        need_float(d[0], "logits")?;
        match *self {
            LossOp::CrossEntropy | LossOp::CrossEntropyBackward => {
                need_i64(d[1], "labels")?;
                if d[2..].iter().any(|&t| t != d[0]) {
                    return Err(MetaError::DType(format!(
                        "dy must have the logits' dtype {}, got {:?}",
                        d[0],
                        &d[2..]
                    )));
                }
                let r = match self {
                    LossOp::CrossEntropy => rules::cross_entropy(s[0], s[1], mode),
                    _ => rules::cross_entropy_backward(s, mode),
                };
                Ok(Inferred::new(shape_rule(r)?, d[0]))
            }
            LossOp::VocabParallelLse { at, parts } => Ok(Inferred::new(
                lse_rules(s[0], at, parts, mode)?,
                d[0].compute(),
            )),
            LossOp::VocabParallel { at } | LossOp::VocabParallelBackward { at } => {
                need_i64(d[1], "labels")?;
                let stats = d[0].compute();
                if d[2..].iter().any(|&t| t != stats) {
                    return Err(MetaError::DType(format!(
                        "lse (and dy) must be {stats} for {} logits, got {:?}",
                        d[0],
                        &d[2..]
                    )));
                }
                let out = if s.len() == 3 { stats } else { d[0] };
                Ok(Inferred::new(vocab_parallel_rules(s, at, mode)?, out))
            }
        }
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        let start = at.input_start(0, 1);
        match *self {
            LossOp::VocabParallelLse { at: a, parts } => Some(LossOp::VocabParallelLse {
                at: ClassShard { start, ..a },
                parts,
            }),
            LossOp::VocabParallel { at: a } => Some(LossOp::VocabParallel {
                at: ClassShard { start, ..a },
            }),
            LossOp::VocabParallelBackward { at: a } => Some(LossOp::VocabParallelBackward {
                at: ClassShard { start, ..a },
            }),
            LossOp::CrossEntropy | LossOp::CrossEntropyBackward => None,
        }
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        match *self {
            LossOp::CrossEntropy => b.cross_entropy(x[0], x[1], y),
            LossOp::CrossEntropyBackward => b.cross_entropy_backward(x[0], x[1], x[2], y),
            LossOp::VocabParallelLse { at, .. } => b.vocab_parallel_lse(x[0], at, y),
            LossOp::VocabParallel { at } => b.vocab_parallel_loss(x[0], x[1], x[2], at, y),
            LossOp::VocabParallelBackward { at } => {
                b.vocab_parallel_backward(x[0], x[1], x[2], x[3], at, y)
            }
        }
    }

    fn differentiable(&self, _output: usize) -> bool {
        !matches!(self, LossOp::VocabParallelLse { .. })
    }

    fn saves(&self, needs: &[bool]) -> Saves {
        let logits = needs.first().copied().unwrap_or(false);
        match self {
            // Logits and labels (and the vocabulary-parallel path's log-sum-exp).
            LossOp::CrossEntropy if logits => Saves::inputs(&[0, 1]),
            LossOp::VocabParallel { .. } if logits => Saves::inputs(&[0, 1, 2]),
            _ => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        match *self {
            LossOp::CrossEntropy => Ok(vec![
                g.when(0, || {
                    Tensor::cross_entropy_backward(g.input(0)?, g.input(1)?, g.dy()?)
                })?,
                None,
            ]),
            // lse is the logits' log-sum-exp, so the whole logits gradient is here.
            LossOp::VocabParallel { at } => {
                let op = LossOp::VocabParallelBackward {
                    at: ClassShard { start: 0, ..at },
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
            LossOp::VocabParallelLse { .. } => Err(Grad::unsupported(
                self.name(),
                "the log-sum-exp partials carry no gradient",
            )),
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

/// Candidates of the log-sum-exp partials `[N, parts]`, per mesh axis: the logits' SBP.
fn lse_rules(x: &Shape, at: ClassShard, parts: usize, mode: RuleMode) -> MetaResult<Rules> {
    let classes = at.classes;
    match x.dims() {
        [n, c] if parts >= 1 && (1..=*c).contains(&classes) => {
            let mut r = Rules::new(mode, [Shape::from([*n, parts])]);
            for sbp in [Sbp::S(1), Sbp::S(0), Sbp::B] {
                r.push(&[sbp], &[sbp]);
            }
            Ok(r)
        }
        _ => Err(MetaError::Shape(format!(
            "needs logits [N, C] with classes {classes} in 1..=C and at least one class \
             shard, got {x} and {parts} shards"
        ))),
    }
}

/// Candidates of the vocabulary-parallel loss and backward, per mesh axis: logits split on the
/// classes with the per-row inputs B -> loss P / dlogits S(1); all split on the rows -> S(0);
/// all B -> B.
fn vocab_parallel_rules(s: &[&Shape], at: ClassShard, mode: RuleMode) -> MetaResult<Rules> {
    let (x, rows) = (s[0], Shape::from([s[0].dim(0), 1]));
    let classes_fit = x.ndim() == 2 && (1..=x.dim(1)).contains(&at.classes);
    if !classes_fit || s[1..].iter().any(|t| **t != rows) {
        return Err(MetaError::Shape(format!(
            "needs logits [N, C] with classes {} in 1..=C and labels, lse (and dy) [N, 1], \
             got {}",
            at.classes,
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
pub(crate) fn vocab_parallel_cross_entropy(
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

/// A per-row tensor `[N, k]` boxed to the layout that fits the class-split logits `x`: split
/// where `x` splits its rows, B elsewhere (only per-row values move), so the
/// vocabulary-parallel ops never box the logits, whatever the sizes.
fn to_row_layout(t: &Tensor, x: &TensorMeta) -> Result<Tensor> {
    let (Some(p), Some(s)) = (x.placement(), x.nd_sbp()) else {
        return Ok(t.clone());
    };
    let rows = NdSbp::new(s.iter().map(|a| if a == Sbp::S(0) { a } else { Sbp::B }));
    t.to_global(p, rows)
}
