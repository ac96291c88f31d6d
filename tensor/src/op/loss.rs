//! Per-sample cross-entropy of logits `[N, C]` against i64 labels `[N]`, and its logits gradient.

use oxiflow_collectives::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    need_float, need_i64, shape_rule, Backend, Inferred, KernelBackend, MetaError, OpFamily,
    OutSpec,
};
use crate::dispatch::dispatch;
use crate::tensor::Tensor;
use crate::Result;

/// The loss family. Inputs: (logits, labels) -> loss [N]; (logits, labels, dy [N]) -> dlogits.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LossOp {
    CrossEntropy,
    CrossEntropyBackward,
}

/// Loss kernels of a backend. Labels out of range are a typed error.
pub trait LossKernels: KernelBackend {
    fn cross_entropy(
        &self,
        logits: &Self::Piece,
        labels: &Self::Piece,
        out: &OutSpec,
    ) -> Result<Self::Piece>;
    fn cross_entropy_backward(
        &self,
        logits: &Self::Piece,
        labels: &Self::Piece,
        dy: &Self::Piece,
        out: &OutSpec,
    ) -> Result<Self::Piece>;
}

impl OpFamily for LossOp {
    fn name(&self) -> &'static str {
        match self {
            LossOp::CrossEntropy => "cross_entropy",
            LossOp::CrossEntropyBackward => "cross_entropy_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            LossOp::CrossEntropy => (2, 2),
            LossOp::CrossEntropyBackward => (3, 3),
        }
    }

    fn infer(
        &self,
        s: &[&Shape],
        d: &[DType],
        mode: RuleMode,
    ) -> std::result::Result<Inferred, MetaError> {
        need_float(d[0], "logits")?;
        need_i64(d[1], "labels")?;
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
        };
        Ok(Inferred::new(shape_rule(r)?, d[0]))
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &OutSpec) -> Result<B::Piece> {
        match self {
            LossOp::CrossEntropy => b.cross_entropy(x[0], x[1], out),
            LossOp::CrossEntropyBackward => b.cross_entropy_backward(x[0], x[1], x[2], out),
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        match self {
            LossOp::CrossEntropy => Ok(vec![
                g.when(0, || Tensor::cross_entropy_backward(&g.x[0], &g.x[1], g.dy))?,
                None,
            ]),
            LossOp::CrossEntropyBackward => Err(Grad::unsupported(
                self.name(),
                "higher-order gradients are not supported",
            )),
        }
    }
}

impl Tensor {
    /// Per-sample cross-entropy of logits `[N, C]` against labels `[N]` (i64) -> `[N]`.
    pub fn cross_entropy(&self, labels: &Tensor) -> Result<Tensor> {
        dispatch(LossOp::CrossEntropy.into(), &[self, labels])
    }
    /// dlogits of the per-sample cross-entropy, given dloss `[N]`.
    pub fn cross_entropy_backward(logits: &Tensor, labels: &Tensor, dy: &Tensor) -> Result<Tensor> {
        dispatch(LossOp::CrossEntropyBackward.into(), &[logits, labels, dy])
    }
}
