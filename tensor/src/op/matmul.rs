//! Matrix products: `a [.., k] @ b [k, n]` and batch matmul `[b.., m, k] @ [b.., k, n]`, and
//! both with either operand's last two dims transposed in the kernel (`matmul_t`), which the
//! backward rules use instead of materialised transposes, also with an accumulator added to
//! the product (`matmul_t_acc`: a backward rule adding its input gradient to the one other
//! consumers gave, in the product's epilogue where the backend has one). Every matmul op
//! carries its [`MatmulPrecision`] (how f32 products run on a device), so dispatch and the
//! compiled step's cache key on it; the backward's products take the forward's. The CPU
//! kernels compute f32 products in f32 whatever it says (TF32 and bf16 inputs are device
//! notions).

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    kernel_trait, same_dtype, shape_rule, single, Inferred, MetaResult, OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// The matmul family: a product and the precision its f32 operands multiply at.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MatmulOp {
    pub product: MatmulProduct,
    pub precision: MatmulPrecision,
}

/// The products of the matmul family.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum MatmulProduct {
    /// a [.., k] x b [k, n] -> [.., n]
    MatMul,
    /// a [b.., m, k] x b [b.., k, n] -> [b.., m, n] (equal batch dims)
    BatchMatMul,
    /// op(a) x op(b) with b 2-d: a [.., m, k] (or [k, m] 2-d with `ta`), b [k, n] (or [n, k]
    /// with `tb`) -> [.., m, n].
    MatMulT { ta: bool, tb: bool },
    /// op(a) x op(b) on the last two dims, equal batch dims.
    BatchMatMulT { ta: bool, tb: bool },
    /// `MatMulT` (or `BatchMatMulT` when `batched`) plus a third operand of the output's
    /// shape and dtype.
    MatMulTAcc { ta: bool, tb: bool, batched: bool },
}

kernel_trait! {
    /// Matmul kernels of a backend (operands of one dtype, shapes as `infer` checked; f32
    /// products at `precision` where the backend has such modes).
    pub trait MatmulKernels {
        fn matmul(a: &Self::Piece, b: &Self::Piece, precision: MatmulPrecision);
        fn batch_matmul(a: &Self::Piece, b: &Self::Piece, precision: MatmulPrecision);
        /// `op(a) @ op(b)` (see `MatmulProduct::MatMulT`; `batched`: `BatchMatMulT`).
        fn matmul_t(
            a: &Self::Piece,
            b: &Self::Piece,
            t: (bool, bool),
            batched: bool,
            precision: MatmulPrecision,
        );
        /// `op(a) @ op(b) + c` (`c` shaped as `out`).
        #[allow(clippy::too_many_arguments)]
        fn matmul_t_acc(
            a: &Self::Piece,
            b: &Self::Piece,
            t: (bool, bool),
            batched: bool,
            c: &Self::Piece,
            precision: MatmulPrecision,
        );
    }
}

impl MatmulOp {
    /// `product` at `precision`.
    pub fn new(product: MatmulProduct, precision: MatmulPrecision) -> MatmulOp {
        MatmulOp { product, precision }
    }
}

impl OpFamily for MatmulOp {
    fn name(&self) -> &'static str {
        match &self.product {
            MatmulProduct::MatMul => "matmul",
            MatmulProduct::BatchMatMul => "batch_matmul",
            MatmulProduct::MatMulT { .. } => "matmul_t",
            MatmulProduct::BatchMatMulT { .. } => "batch_matmul_t",
            MatmulProduct::MatMulTAcc { .. } => "matmul_t_acc",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match &self.product {
            MatmulProduct::MatMulTAcc { .. } => (3, 3),
            _ => (2, 2),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = same_dtype(d)?;
        let r = match &self.product {
            MatmulProduct::MatMul => rules::matmul(s[0], s[1], mode),
            MatmulProduct::BatchMatMul => rules::batch_matmul(s[0], s[1], mode),
            MatmulProduct::MatMulT { ta, tb } => {
                rules::matmul_t(s[0], s[1], (*ta, *tb), false, mode)
            }
            MatmulProduct::BatchMatMulT { ta, tb } => {
                rules::matmul_t(s[0], s[1], (*ta, *tb), true, mode)
            }
            MatmulProduct::MatMulTAcc { ta, tb, batched } => {
                rules::matmul_t(s[0], s[1], (*ta, *tb), *batched, mode).and_then(|r| {
                    match r.out_shapes().first() {
                        Some(y) if y == s[2] => Ok(r.with_accumulator(0)),
                        y => Err(format!(
                            "the accumulator {} is not the product's shape {}",
                            s[2],
                            y.map_or("?".to_string(), Shape::to_string)
                        )),
                    }
                })
            }
        };
        Ok(Inferred::new(shape_rule(r)?, dt))
    }

    fn saves(&self, needs: &[bool]) -> Saves {
        // dA reads B and dB reads A: each operand only for the other's gradient.
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        Saves::NOTHING
            .and_input_if(0, need(1))
            .and_input_if(1, need(0))
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (am, bm, dy) = (g.input_meta(0), g.input_meta(1), g.dy()?);
        let (ta, tb) = match &self.product {
            MatmulProduct::MatMul | MatmulProduct::BatchMatMul => (false, false),
            MatmulProduct::MatMulT { ta, tb }
            | MatmulProduct::BatchMatMulT { ta, tb }
            | MatmulProduct::MatMulTAcc { ta, tb, .. } => (*ta, *tb),
        };
        let batched = match &self.product {
            MatmulProduct::BatchMatMul | MatmulProduct::BatchMatMulT { .. } => true,
            MatmulProduct::MatMulTAcc { batched, .. } => *batched,
            MatmulProduct::MatMul | MatmulProduct::MatMulT { .. } => false,
        };
        // The accumulator's gradient is the output's.
        let gc = match &self.product {
            MatmulProduct::MatMulTAcc { .. } => Some(g.when(2, || Ok(dy.clone()))?),
            _ => None,
        };
        if !batched && am.ndim() < 2 {
            // a [k] (never transposed): the plain rules on materialised transposes.
            let ga = g.when(0, || {
                dy.matmul_at(&g.input(1)?.transpose(-2, -1)?, self.precision)
            })?;
            let gb = g.when(1, || {
                let (k, n) = (bm.shape().dim(0), bm.shape().dim(1));
                g.input(0)?.reshape([1, k])?.matmul_t_at(
                    &dy.reshape([1, n])?,
                    (true, false),
                    self.precision,
                )
            })?;
            return Ok([ga, gb].into_iter().chain(gc).collect());
        }
        let mm = |x: &Tensor, y: &Tensor, tx: bool, ty: bool| {
            let product = if batched {
                MatmulProduct::BatchMatMulT { ta: tx, tb: ty }
            } else {
                MatmulProduct::MatMulT { ta: tx, tb: ty }
            };
            Tensor::apply(MatmulOp::new(product, self.precision), &[x, y])
        };
        // C = A B with A = op(a), B = op(b): dA = dC B^T, dB = A^T dC; a transposed operand
        // gets the transpose of its gradient, written as products of the stored operands.
        let ga = g.when(0, || {
            let b = g.input(1)?;
            if ta {
                mm(b, dy, tb, true)
            } else {
                mm(dy, b, false, !tb)
            }
        })?;
        let gb = g.when(1, || {
            let a = g.input(0)?;
            // Unbatched, a [.., m, k] and dy [.., m, n] contract over all leading dims.
            let (a2, dy2) = if !batched && a.ndim() > 2 {
                let (k, n) = (a.shape().dim(a.ndim() - 1), dy.shape().dim(dy.ndim() - 1));
                (
                    a.reshape([a.numel() / k.max(1), k])?,
                    dy.reshape([dy.numel() / n.max(1), n])?,
                )
            } else {
                (a.clone(), dy.clone())
            };
            if tb {
                mm(&dy2, &a2, true, ta)
            } else {
                mm(&a2, &dy2, !ta, false)
            }
        })?;
        Ok([ga, gb].into_iter().chain(gc).collect())
    }
}

impl<B: MatmulKernels> RunKernels<B> for MatmulOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let (y, p) = (single(self.name(), out)?, self.precision);
        match &self.product {
            MatmulProduct::MatMul => b.matmul(x[0], x[1], p, y),
            MatmulProduct::BatchMatMul => b.batch_matmul(x[0], x[1], p, y),
            MatmulProduct::MatMulT { ta, tb } => b.matmul_t(x[0], x[1], (*ta, *tb), false, p, y),
            MatmulProduct::BatchMatMulT { ta, tb } => {
                b.matmul_t(x[0], x[1], (*ta, *tb), true, p, y)
            }
            MatmulProduct::MatMulTAcc { ta, tb, batched } => {
                b.matmul_t_acc(x[0], x[1], (*ta, *tb), *batched, x[2], p, y)
            }
        }
    }
}
