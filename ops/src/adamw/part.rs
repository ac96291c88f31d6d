//! One pass of an AdamW update ([`AdamPart`]): its coefficients, operands and metadata.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{F64Bits, Inferred, MetaError, MetaResult};

use crate::operand_dtypes::one_float_dtype;
use crate::operand_shapes::shapes_text;

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

    /// The pass's op name.
    pub fn op_name(&self) -> &'static str {
        match self {
            AdamPart::Moment1 { .. } => "adam_moment1",
            AdamPart::Moment2 { .. } => "adam_moment2",
            AdamPart::Update { .. } => "adam_update",
        }
    }

    /// The pass's kind and coefficients as bytes (the op's attributes).
    pub(super) fn key(&self, key: &mut Vec<u8>) {
        let kind: u8 = match self {
            AdamPart::Moment1 { .. } => 0,
            AdamPart::Moment2 { .. } => 1,
            AdamPart::Update { .. } => 2,
        };
        key.push(kind);
        for c in self.coefficients() {
            key.extend_from_slice(&c.to_bits().to_le_bytes());
        }
    }

    /// The output's dtype and rules: same-shape operands of one float dtype.
    pub(super) fn meta(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = one_float_dtype(d)?;
        if s.iter().any(|x| *x != s[0]) {
            return Err(MetaError::Shape(format!(
                "the operands must have one shape, got {}",
                shapes_text(s)
            )));
        }
        // Non-linear in every operand: all split alike, or all whole.
        let r = rules::pointwise(s, 1, &[], mode).map_err(MetaError::Shape)?;
        Ok(Inferred::new(r, dt))
    }
}
