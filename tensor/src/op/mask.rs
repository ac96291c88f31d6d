//! Element-wise selection: `where_cond` (a condition picks between two values), `masked_fill`
//! (a mask replaces values by a constant) and the triangular masks `triu`/`tril` on the last two
//! dims, whose kernel reads the global row and column of its piece, so any split works.
//! Conditions and masks may have any dtype: nonzero is true.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::{sum_to, zeros_on, Grad};
use super::{
    kernel_trait, same_dtype, shape_rule, single, F64Bits, Inferred, LocalAt, MetaError,
    MetaResult, OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// Which triangle a triangular mask keeps: on or above diagonal `k` (`col - row >= k`), or on
/// or below it (`col - row <= k`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Triangle {
    Upper,
    Lower,
}

/// The mask family.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum MaskOp {
    /// (cond, a, b) -> a where cond is nonzero, else b (all three broadcast).
    Where,
    /// (x, mask) -> x with `value` where mask is nonzero (the mask broadcasts to x).
    MaskedFill { value: F64Bits },
    /// (x [.., R, C]) -> x with zeros outside the triangle; `row0`/`col0`: the global row and
    /// column of the piece's first element (set by `local`).
    Triangular {
        keep: Triangle,
        k: i64,
        row0: usize,
        col0: usize,
    },
}

kernel_trait! {
    /// Mask kernels of a backend (pieces of f32/f64/i64; conditions and masks of any dtype).
    pub trait MaskKernels {
        fn where_cond(cond: &Self::Piece, a: &Self::Piece, b: &Self::Piece);
        fn masked_fill(x: &Self::Piece, mask: &Self::Piece, value: f64);
        /// Zeros outside the triangle; (`row0`, `col0`): global position of the piece's corner.
        fn triangular(x: &Self::Piece, keep: Triangle, k: i64, row0: usize, col0: usize);
    }
}

impl OpFamily for MaskOp {
    fn name(&self) -> &'static str {
        match self {
            MaskOp::Where => "where",
            MaskOp::MaskedFill { .. } => "masked_fill",
            MaskOp::Triangular {
                keep: Triangle::Upper,
                ..
            } => "triu",
            MaskOp::Triangular { .. } => "tril",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            MaskOp::Where => (3, 3),
            MaskOp::MaskedFill { .. } => (2, 2),
            MaskOp::Triangular { .. } => (1, 1),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        match self {
            MaskOp::Where => {
                let dt = same_dtype(&d[1..])?;
                Ok(Inferred::new(
                    shape_rule(rules::where_cond(s[0], s[1], s[2], mode))?,
                    dt,
                ))
            }
            MaskOp::MaskedFill { value } => Ok(Inferred::new(
                shape_rule(rules::masked_fill(s[0], s[1], value.get() == 0.0, mode))?,
                d[0],
            )),
            MaskOp::Triangular { .. } => {
                if s[0].ndim() < 2 {
                    return Err(MetaError::Shape(format!(
                        "needs at least 2 dims, got {}",
                        s[0]
                    )));
                }
                Ok(Inferred::new(rules::positional(s[0], &[], mode), d[0]))
            }
        }
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        let MaskOp::Triangular { keep, k, .. } = *self else {
            return None;
        };
        let nd = at.global_inputs.first().map_or(0, |s| s.ndim());
        Some(MaskOp::Triangular {
            keep,
            k,
            row0: at.input_start(0, nd.saturating_sub(2)),
            col0: at.input_start(0, nd.saturating_sub(1)),
        })
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            MaskOp::Where => Saves::inputs(&[0]),
            MaskOp::MaskedFill { .. } => Saves::inputs(&[1]),
            MaskOp::Triangular { .. } => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let dy = g.dy()?;
        match *self {
            MaskOp::Where => {
                let cond = g.input(0)?;
                let zero = zeros_on(&dy.meta(), Shape::scalar())?;
                Ok(vec![
                    None,
                    g.when(1, || {
                        sum_to(Tensor::where_cond(cond, dy, &zero)?, g.input_meta(1))
                    })?,
                    g.when(2, || {
                        sum_to(Tensor::where_cond(cond, &zero, dy)?, g.input_meta(2))
                    })?,
                ])
            }
            MaskOp::MaskedFill { .. } => {
                Ok(vec![g.when(0, || dy.masked_fill(g.input(1)?, 0.0))?, None])
            }
            MaskOp::Triangular { keep, k, .. } => Grad::one(triangular(dy, keep, k)?),
        }
    }
}

impl<B: MaskKernels> RunKernels<B> for MaskOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        match *self {
            MaskOp::Where => b.where_cond(x[0], x[1], x[2], y),
            MaskOp::MaskedFill { value } => b.masked_fill(x[0], x[1], value.get(), y),
            MaskOp::Triangular {
                keep,
                k,
                row0,
                col0,
            } => b.triangular(x[0], keep, k, row0, col0, y),
        }
    }
}

/// `x` with the entries outside the triangle `keep` of its last two dims from diagonal `k`
/// zeroed.
pub(crate) fn triangular(x: &Tensor, keep: Triangle, k: i64) -> Result<Tensor> {
    let op = MaskOp::Triangular {
        keep,
        k,
        row0: 0,
        col0: 0,
    };
    Tensor::apply(op, &[x])
}
