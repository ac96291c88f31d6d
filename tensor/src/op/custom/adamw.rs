//! Fused AdamW, the first custom op: three element-wise passes per parameter (the two moments
//! and the new value), each reading its same-shape float operands once; no gradient.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use crate::op::{
    need_float, no_gradient, same_dtype, shape_rule, single, CustomKernels, F64Bits, Inferred,
    KernelBackend, MetaError, MetaResult, OpFamily, RunKernels,
};
use crate::Result;

/// One pass of an AdamW update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AdamPart {
    /// (m, g) -> a m + b g (the first moment).
    Moment1 { a: F64Bits, b: F64Bits },
    /// (v, g) -> a v + b g^2 (the second moment).
    Moment2 { a: F64Bits, b: F64Bits },
    /// (p, m, v) -> decay p - (step m) / (sqrt(inv_bc2 v) + eps) (the new value).
    Update {
        decay: F64Bits,
        step: F64Bits,
        inv_bc2: F64Bits,
        eps: F64Bits,
    },
}

impl AdamPart {
    /// (a, b, c, d) of the kernels' common form (see the variants).
    pub fn coefficients(self) -> [f64; 4] {
        match self {
            AdamPart::Moment1 { a, b } | AdamPart::Moment2 { a, b } => [a.get(), b.get(), 0.0, 0.0],
            AdamPart::Update {
                decay,
                step,
                inv_bc2,
                eps,
            } => [decay.get(), step.get(), inv_bc2.get(), eps.get()],
        }
    }
    /// Number of operands: 2 for the moments, 3 for the update.
    pub fn operands(self) -> usize {
        match self {
            AdamPart::Update { .. } => 3,
            AdamPart::Moment1 { .. } | AdamPart::Moment2 { .. } => 2,
        }
    }
}

/// AdamW kernels of a backend: one pass on same-shape float operands of one dtype.
pub trait AdamWKernels: KernelBackend {
    fn adam(&self, part: AdamPart, x: &[&Self::Piece], out: &mut Self::Out) -> Result<()>;
}

impl OpFamily for AdamPart {
    fn name(&self) -> &'static str {
        match self {
            AdamPart::Moment1 { .. } => "adam_moment1",
            AdamPart::Moment2 { .. } => "adam_moment2",
            AdamPart::Update { .. } => "adam_update",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (self.operands(), self.operands())
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = same_dtype(d)?;
        need_float(dt, "input")?;
        if s.iter().any(|x| *x != s[0]) {
            return Err(MetaError::Shape(format!(
                "the operands must have one shape, got {}",
                s.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        // Non-linear in every operand: all split alike, or all whole.
        Ok(Inferred::new(shape_rule(rules::pointwise(s, 1, &[], mode))?, dt))
    }

    no_gradient!("an optimizer update has no gradient");
}

impl<B: CustomKernels> RunKernels<B> for AdamPart {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        b.adam(*self, x, single(self.name(), out)?)
    }
}
