//! Per-sample cross-entropy of logits `[N, C]` against i64 labels `[N]`, and its logits gradient.
//! Logits split on the classes take the vocabulary-parallel path: one fused pass per class shard
//! gives each shard's log-sum-exp, and only per-row partials move between ranks, so the logits
//! are never gathered, copied or masked.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, NdSbp, RuleMode, Sbp, Shape};

use super::grad::Grad;
use super::{
    kernel_trait, need_float, need_i64, shape_rule, single, Inferred, LocalAt, MetaError,
    MetaResult, OpFamily, RunKernels, Saves,
};
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

kernel_trait! {
    /// Loss kernels of a backend. Labels out of range are a typed error (NaN rows on devices,
    /// which cannot raise one without a synchronisation).
    pub trait LossKernels {
        fn cross_entropy(logits: &Self::Piece, labels: &Self::Piece);
        fn cross_entropy_backward(logits: &Self::Piece, labels: &Self::Piece, dy: &Self::Piece);
        /// `out` `[rows, 1]` (compute dtype): per row of `logits` `[rows, width]`, the log-sum-exp
        /// of its class columns (`at.class_columns(width)`), -inf where there are none; one pass
        /// (a running max and the sum of exponentials relative to it), no temporary of the
        /// logits' size.
        fn vocab_parallel_lse(logits: &Self::Piece, at: ClassShard);
        /// `out` `[rows, 1]` (compute dtype): `lse` where `at.start` is 0 (else 0), minus the
        /// row's label logit where this piece holds its column.
        fn vocab_parallel_loss(
            logits: &Self::Piece,
            labels: &Self::Piece,
            lse: &Self::Piece,
            at: ClassShard,
        );
        /// `out` of the logits' shape and dtype: `dy (exp(logits - lse) - onehot(label))` in the
        /// class columns, exactly 0 in the padding columns.
        fn vocab_parallel_backward(
            logits: &Self::Piece,
            labels: &Self::Piece,
            lse: &Self::Piece,
            dy: &Self::Piece,
            at: ClassShard,
        );
    }
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
                shape_rule(rules::vocab_parallel_lse(s[0], at.classes, parts, mode))?,
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
                let r = shape_rule(rules::vocab_parallel(s, at.classes, mode))?;
                Ok(Inferred::new(r, out))
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
                        Tensor::apply(op, &[x, labels, lse, &dy])
                    })?,
                    None,
                    None,
                ])
            }
            LossOp::VocabParallelLse { .. } => Err(Grad::unsupported(
                self.name(),
                "the log-sum-exp partials carry no gradient",
            )),
            LossOp::CrossEntropyBackward | LossOp::VocabParallelBackward { .. } => {
                Err(Grad::higher_order(self.name()))
            }
        }
    }
}

impl<B: LossKernels> RunKernels<B> for LossOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
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
}

/// A per-row tensor `[N, k]` boxed to the layout that fits the class-split logits `x`: split
/// where `x` splits its rows, B elsewhere (only per-row values move), so the
/// vocabulary-parallel ops never box the logits, whatever the sizes.
pub(crate) fn to_row_layout(t: &Tensor, x: &TensorMeta) -> Result<Tensor> {
    let (Some(p), Some(s)) = (x.placement(), x.nd_sbp()) else {
        return Ok(t.clone());
    };
    let rows = NdSbp::new(s.iter().map(|a| if a == Sbp::S(0) { a } else { Sbp::B }));
    t.to_global(p, rows)
}
