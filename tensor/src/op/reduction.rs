//! Reductions: sum, mean, max and min over dims (with keepdim), and sum-to-shape, the reverse of
//! broadcasting (the gradient of a broadcast operand).

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::{keepdim_shape, zeros_like, Grad};
use super::{
    kernel_trait, need_float, shape_rule, single, Dims, Inferred, LocalAt, MetaResult, OpFamily,
    RunKernels, Saves, UnaryOp,
};
use crate::tensor::Tensor;
use crate::Result;
use oxiflow_sbp::ReduceKind;

/// The reduction family. `dims` are sorted, distinct and in range (the `Tensor` methods
/// normalize them); no dims is the identity (the reduction of a 0-d tensor).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReductionOp {
    Sum {
        dims: Dims,
        keepdim: bool,
    },
    /// Sum, then multiplied by 1 / `count` where `count` is the number of reduced elements of
    /// the *global* shape (0 in the global op; `local` fills it in).
    Mean {
        dims: Dims,
        keepdim: bool,
        count: usize,
    },
    Max {
        dims: Dims,
        keepdim: bool,
    },
    Min {
        dims: Dims,
        keepdim: bool,
    },
    /// Sums broadcast dims away so the result has `shape` (the reverse of broadcasting).
    SumToShape {
        shape: Shape,
    },
}

/// Which extremum a max or min reduction keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Extremum {
    Max,
    Min,
}

impl Extremum {
    /// The reduction's name, as errors print it.
    pub fn name(self) -> &'static str {
        match self {
            Extremum::Max => "max",
            Extremum::Min => "min",
        }
    }
}

kernel_trait! {
    /// Reduction kernels of a backend. `sum` divides by `count` when given (a mean). The output
    /// buffer's shape says whether the reduced dims are kept.
    pub trait ReductionKernels {
        fn sum(x: &Self::Piece, dims: &[usize], keepdim: bool, count: Option<usize>);
        /// The max or min over `dims`.
        fn extremum(which: Extremum, x: &Self::Piece, dims: &[usize]);
        /// Sums `x` down to `out.shape`, which broadcasts to `x`'s shape.
        fn sum_to_shape(x: &Self::Piece);
    }
}

/// The number of elements a reduction over `dims` of `shape` combines (at least 1).
fn reduced_count(shape: &Shape, dims: &[usize]) -> usize {
    dims.iter().map(|&d| shape.dim(d)).product::<usize>().max(1)
}

impl OpFamily for ReductionOp {
    fn name(&self) -> &'static str {
        match self {
            ReductionOp::Sum { .. } => "sum",
            ReductionOp::Mean { .. } => "mean",
            ReductionOp::Max { .. } => "max",
            ReductionOp::Min { .. } => "min",
            ReductionOp::SumToShape { .. } => "sum_to_shape",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (1, 1)
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let (kind, dims, keepdim) = match self {
            ReductionOp::Sum { dims, keepdim } => (ReduceKind::Sum, dims, *keepdim),
            ReductionOp::Mean { dims, keepdim, .. } => {
                need_float(d[0], "input")?;
                (ReduceKind::Mean, dims, *keepdim)
            }
            ReductionOp::Max { dims, keepdim } => (ReduceKind::Max, dims, *keepdim),
            ReductionOp::Min { dims, keepdim } => (ReduceKind::Min, dims, *keepdim),
            ReductionOp::SumToShape { shape } => {
                return Ok(Inferred::new(
                    shape_rule(rules::reduce_to_shape(s[0], shape, mode))?,
                    d[0],
                ))
            }
        };
        Ok(Inferred::new(
            shape_rule(rules::reduce(kind, dims, keepdim, s[0], mode))?,
            d[0],
        ))
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        match self {
            ReductionOp::Mean { dims, keepdim, .. } => Some(ReductionOp::Mean {
                dims: dims.clone(),
                keepdim: *keepdim,
                count: reduced_count(at.global_inputs[0], dims),
            }),
            ReductionOp::SumToShape { .. } => Some(ReductionOp::SumToShape {
                shape: at.out_local.clone(),
            }),
            _ => None,
        }
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            // The extrema's positions: where x equals the output.
            ReductionOp::Max { .. } | ReductionOp::Min { .. } => {
                Saves::inputs(&[0]).and_outputs(&[0])
            }
            _ => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (xm, dy) = (g.input_meta(0), g.dy()?);
        // dy with the reduced dims kept as size 1, so it broadcasts against x.
        let kept = |dims: &[usize], keepdim: bool, t: &Tensor| -> Result<Tensor> {
            if keepdim {
                Ok(t.clone())
            } else {
                t.reshape(keepdim_shape(xm.shape(), dims))
            }
        };
        match self {
            ReductionOp::Sum { dims, keepdim } => {
                Grad::one(zeros_like(xm)?.add(&kept(dims, *keepdim, dy)?)?)
            }
            ReductionOp::Mean { dims, keepdim, .. } => {
                let count = reduced_count(xm.shape(), dims);
                Grad::one(
                    zeros_like(xm)?
                        .add(&kept(dims, *keepdim, dy)?)?
                        .mul_scalar(1.0 / count as f64)?,
                )
            }
            ReductionOp::Max { dims, keepdim } | ReductionOp::Min { dims, keepdim } => {
                // Gradient split evenly among the extrema: mask = (x == max) as
                // 1 - sign(x - max)^2.
                let diff = g.input(0)?.sub(&kept(dims, *keepdim, g.output(0)?)?)?;
                let ones = zeros_like(xm)?.add_scalar(1.0)?;
                let mask = ones
                    .unary_backward(UnaryOp::Abs, &diff)?
                    .square()?
                    .rsub_scalar(1.0)?;
                let dimsi: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
                let count = mask.sum(&dimsi, true)?;
                Grad::one(mask.mul(&kept(dims, *keepdim, dy)?.div(&count)?)?)
            }
            // sum_to_shape is linear: its backward broadcasts dy back.
            ReductionOp::SumToShape { .. } => Grad::one(zeros_like(xm)?.add(dy)?),
        }
    }
}

impl<B: ReductionKernels> RunKernels<B> for ReductionOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        match self {
            ReductionOp::Sum { dims, keepdim } => b.sum(x[0], dims, *keepdim, None, y),
            ReductionOp::Mean {
                dims,
                keepdim,
                count,
            } => b.sum(x[0], dims, *keepdim, Some((*count).max(1)), y),
            ReductionOp::Max { dims, .. } => b.extremum(Extremum::Max, x[0], dims, y),
            ReductionOp::Min { dims, .. } => b.extremum(Extremum::Min, x[0], dims, y),
            ReductionOp::SumToShape { .. } => b.sum_to_shape(x[0], y),
        }
    }
}
