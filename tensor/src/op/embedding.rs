//! Embedding lookup (rows of a weight at integer ids) and its weight gradient (scatter-add).

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

/// The embedding family. Inputs: (ids [..] i64, weight [V, H]) and (ids [..], dy [.., H]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EmbeddingOp {
    /// -> [.., H]
    Lookup,
    /// -> dweight [num, H]; `local` gives each rank its piece's row count.
    Backward { num: usize },
}

/// Embedding kernels of a backend. Ids out of range are a typed error.
pub trait EmbeddingKernels: KernelBackend {
    fn embedding(
        &self,
        ids: &Self::Piece,
        weight: &Self::Piece,
        out: &OutSpec,
    ) -> Result<Self::Piece>;
    fn embedding_backward(
        &self,
        ids: &Self::Piece,
        dy: &Self::Piece,
        num: usize,
        out: &OutSpec,
    ) -> Result<Self::Piece>;
}

impl OpFamily for EmbeddingOp {
    fn name(&self) -> &'static str {
        match self {
            EmbeddingOp::Lookup => "embedding",
            EmbeddingOp::Backward { .. } => "embedding_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (2, 2)
    }

    fn infer(
        &self,
        s: &[&Shape],
        d: &[DType],
        mode: RuleMode,
    ) -> std::result::Result<Inferred, MetaError> {
        need_i64(d[0], "ids")?;
        match self {
            EmbeddingOp::Lookup => {
                need_float(d[1], "weight")?;
                Ok(Inferred::new(
                    shape_rule(rules::embedding(s[0], s[1], mode))?,
                    d[1],
                ))
            }
            EmbeddingOp::Backward { num } => {
                need_float(d[1], "dy")?;
                Ok(Inferred::new(
                    shape_rule(rules::embedding_backward(*num, s[0], s[1], mode))?,
                    d[1],
                ))
            }
        }
    }

    fn local(&self, _global_inputs: &[&Shape], out_local: &Shape) -> Option<Self> {
        match self {
            EmbeddingOp::Backward { .. } => Some(EmbeddingOp::Backward {
                num: out_local.dim(0),
            }),
            EmbeddingOp::Lookup => None,
        }
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &OutSpec) -> Result<B::Piece> {
        match self {
            EmbeddingOp::Lookup => b.embedding(x[0], x[1], out),
            EmbeddingOp::Backward { num } => b.embedding_backward(x[0], x[1], *num, out),
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        match self {
            EmbeddingOp::Lookup => {
                let num = g.x[1].shape().dim(0);
                Ok(vec![
                    None,
                    g.when(1, || Tensor::embedding_backward(&g.x[0], g.dy, num))?,
                ])
            }
            EmbeddingOp::Backward { .. } => Err(Grad::unsupported(
                self.name(),
                "higher-order gradients are not supported",
            )),
        }
    }
}

impl Tensor {
    /// Rows of `weight [V, H]` at `ids [..]` (i64) -> `[.., H]`.
    pub fn embedding(ids: &Tensor, weight: &Tensor) -> Result<Tensor> {
        dispatch(EmbeddingOp::Lookup.into(), &[ids, weight])
    }
    /// Weight gradient `[num, H]` of an embedding lookup: scatter-add of dy rows at ids.
    pub fn embedding_backward(ids: &Tensor, dy: &Tensor, num: usize) -> Result<Tensor> {
        dispatch(EmbeddingOp::Backward { num }.into(), &[ids, dy])
    }
}
