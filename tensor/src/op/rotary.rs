//! Rotary position embedding (GPT-NeoX / LLaMA layout) on `[.., T, .., D]`: the pairs
//! (i, i + D/2) of the last dim rotate by `pos * base^(-2i/D)`, `pos` the op's first position
//! plus the global index along the sequence dim (from the piece's region, so a sequence split
//! works). Linear in x; the
//! backward is the inverse rotation.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    dim_ok, kernel_trait, need_float, single, F64Bits, Inferred, LocalAt, MetaError, MetaResult,
    OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// The rotary family. `pos0`: the global sequence position of the piece's first row (set by
/// `local`); `inverse` rotates the other way.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RotaryOp {
    pub seq_dim: usize,
    pub base: F64Bits,
    pub inverse: bool,
    pub pos0: usize,
}

kernel_trait! {
    /// Rotary kernels of a backend (float pieces).
    pub trait RotaryKernels {
        fn rotary(x: &Self::Piece, op: &RotaryOp);
    }
}

impl OpFamily for RotaryOp {
    fn name(&self) -> &'static str {
        if self.inverse {
            "rotary_backward"
        } else {
            "rotary"
        }
    }

    fn arity(&self) -> (usize, usize) {
        (1, 1)
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        need_float(d[0], "input")?;
        let x = s[0];
        dim_ok(x, self.seq_dim)?;
        let last = x.ndim() - 1;
        if self.seq_dim == last || !x.dim(last).is_multiple_of(2) {
            return Err(MetaError::Shape(format!(
                "needs an even last dim apart from the sequence dim {}, got {x}",
                self.seq_dim
            )));
        }
        let base = self.base.get();
        if !(base.is_finite() && base > 0.0) {
            return Err(MetaError::Shape(format!(
                "base must be finite and positive, got {base}"
            )));
        }
        Ok(Inferred::new(rules::positional(x, &[last], mode), d[0]))
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        Some(RotaryOp {
            pos0: self.pos0 + at.input_start(0, self.seq_dim),
            ..self.clone()
        })
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        Saves::NOTHING
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let op = RotaryOp {
            inverse: !self.inverse,
            ..self.clone()
        };
        Grad::one(Tensor::apply(op, &[g.dy()?])?)
    }
}

impl<B: RotaryKernels> RunKernels<B> for RotaryOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        b.rotary(x[0], self, y)
    }
}
