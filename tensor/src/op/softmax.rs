//! Softmax and log-softmax over one dim, and their backward from the output and its gradient.

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    dim_ok, kernel_trait, same_float_dtype, shape_rule, single, Inferred, MetaError, MetaResult,
    OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// The softmax family; `log` selects log-softmax.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SoftmaxOp {
    Forward {
        dim: usize,
        log: bool,
    },
    /// (y, dy) -> dx for y = (log_)softmax(x, dim); `feeds`: the precision of the products
    /// dx feeds (attention's dS; bf16: a device kernel writes dx's bf16 copy with it).
    Backward {
        dim: usize,
        log: bool,
        feeds: MatmulPrecision,
    },
}

kernel_trait! {
    /// Softmax kernels of a backend (float pieces).
    pub trait SoftmaxKernels {
        fn softmax(x: &Self::Piece, dim: usize, log: bool);
        fn softmax_backward(
            y: &Self::Piece,
            dy: &Self::Piece,
            dim: usize,
            log: bool,
            feeds: MatmulPrecision,
        );
    }
}

impl OpFamily for SoftmaxOp {
    fn name(&self) -> &'static str {
        match self {
            SoftmaxOp::Forward { log: false, .. } => "softmax",
            SoftmaxOp::Forward { log: true, .. } => "log_softmax",
            SoftmaxOp::Backward { log: false, .. } => "softmax_backward",
            SoftmaxOp::Backward { log: true, .. } => "log_softmax_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            SoftmaxOp::Forward { .. } => (1, 1),
            SoftmaxOp::Backward { .. } => (2, 2),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = same_float_dtype(d, "input")?;
        match self {
            SoftmaxOp::Forward { dim, .. } => {
                dim_ok(s[0], *dim)?;
                Ok(Inferred::new(
                    shape_rule(rules::softmax(*dim, s[0], mode))?,
                    dt,
                ))
            }
            SoftmaxOp::Backward { dim, .. } => {
                dim_ok(s[0], *dim)?;
                if s[0] != s[1] {
                    return Err(MetaError::Shape(format!(
                        "dy and the saved tensor differ: {} vs {}",
                        s[0], s[1]
                    )));
                }
                Ok(Inferred::new(
                    shape_rule(rules::softmax_backward(*dim, s[0], s[1], mode))?,
                    dt,
                ))
            }
        }
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            SoftmaxOp::Forward { .. } => Saves::outputs(&[0]),
            SoftmaxOp::Backward { .. } => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        match self {
            SoftmaxOp::Forward { dim, log } => Grad::one(Tensor::apply(
                SoftmaxOp::Backward {
                    dim: *dim,
                    log: *log,
                    feeds: MatmulPrecision::F32,
                },
                &[g.output(0)?, g.dy()?],
            )?),
            SoftmaxOp::Backward { .. } => Err(Grad::higher_order(self.name())),
        }
    }
}

impl<B: SoftmaxKernels> RunKernels<B> for SoftmaxOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        match self {
            SoftmaxOp::Forward { dim, log } => b.softmax(x[0], *dim, *log, y),
            SoftmaxOp::Backward { dim, log, feeds } => {
                b.softmax_backward(x[0], x[1], *dim, *log, *feeds, y)
            }
        }
    }
}
