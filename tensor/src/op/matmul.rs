//! Matrix products: `a [.., k] @ b [k, n]` and batch matmul `[b.., m, k] @ [b.., k, n]`.

use oxiflow_collectives::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    same_dtype, shape_rule, Backend, Inferred, KernelBackend, MetaError, OpFamily, OutSpec,
};
use crate::dispatch::dispatch;
use crate::tensor::Tensor;
use crate::Result;

/// The matmul family.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum MatmulOp {
    /// a [.., k] x b [k, n] -> [.., n]
    MatMul,
    /// a [b.., m, k] x b [b.., k, n] -> [b.., m, n] (equal batch dims)
    BatchMatMul,
}

/// Matmul kernels of a backend (operands of one dtype, shapes as `infer` checked).
pub trait MatmulKernels: KernelBackend {
    fn matmul(&self, a: &Self::Piece, b: &Self::Piece, out: &OutSpec) -> Result<Self::Piece>;
    fn batch_matmul(&self, a: &Self::Piece, b: &Self::Piece, out: &OutSpec) -> Result<Self::Piece>;
}

impl OpFamily for MatmulOp {
    fn name(&self) -> &'static str {
        match self {
            MatmulOp::MatMul => "matmul",
            MatmulOp::BatchMatMul => "batch_matmul",
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
        let dt = same_dtype(d)?;
        let r = match self {
            MatmulOp::MatMul => rules::matmul(s[0], s[1], mode),
            MatmulOp::BatchMatMul => rules::batch_matmul(s[0], s[1], mode),
        };
        Ok(Inferred::new(shape_rule(r)?, dt))
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &OutSpec) -> Result<B::Piece> {
        match self {
            MatmulOp::MatMul => b.matmul(x[0], x[1], out),
            MatmulOp::BatchMatMul => b.batch_matmul(x[0], x[1], out),
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (a, b, dy) = (&g.x[0], &g.x[1], g.dy);
        match self {
            MatmulOp::MatMul => {
                let ga = g.when(0, || dy.matmul(&b.transpose(-2, -1)?))?;
                let gb = g.when(1, || {
                    let (k, n) = (b.shape().dim(0), b.shape().dim(1));
                    let (a2, dy2) = if a.ndim() == 2 {
                        (a.clone(), dy.clone())
                    } else {
                        let m = a.numel() / k.max(1);
                        (a.reshape([m, k])?, dy.reshape([m, n])?)
                    };
                    a2.transpose(-2, -1)?.matmul(&dy2)
                })?;
                Ok(vec![ga, gb])
            }
            MatmulOp::BatchMatMul => Ok(vec![
                g.when(0, || dy.bmm(&b.transpose(-2, -1)?))?,
                g.when(1, || a.transpose(-2, -1)?.bmm(dy))?,
            ]),
        }
    }
}

impl Tensor {
    /// Matrix product. `b` 2-d: `self [.., k] @ b [k, n]`; otherwise batch matmul with equal
    /// batch dims.
    pub fn matmul(&self, b: &Tensor) -> Result<Tensor> {
        if b.ndim() != 2 {
            return self.bmm(b);
        }
        dispatch(MatmulOp::MatMul.into(), &[self, b])
    }
    /// Batch matmul `[b.., m, k] @ [b.., k, n]`.
    pub fn bmm(&self, b: &Tensor) -> Result<Tensor> {
        dispatch(MatmulOp::BatchMatMul.into(), &[self, b])
    }
}
