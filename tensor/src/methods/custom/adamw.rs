//! The `Tensor` methods of the custom op `op/custom/adamw.rs`: they build its
//! ops and dispatch them.

use crate::dispatch::dispatch;
use crate::op::custom::AdamPart;
use crate::op::F64Bits;
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// AdamW's moment update in one pass: `a self + b g` (`squared`: `a self + b g^2`).
    pub fn adam_moment(&self, g: &Tensor, a: f64, b: f64, squared: bool) -> Result<Tensor> {
        let (a, b) = (F64Bits::new(a), F64Bits::new(b));
        let part = if squared {
            AdamPart::Moment2 { a, b }
        } else {
            AdamPart::Moment1 { a, b }
        };
        dispatch(part.into(), &[self, g])
    }
    /// AdamW's new value in one pass: `decay self - (step m) / (sqrt(inv_bc2 v) + eps)`.
    pub fn adam_update(
        &self,
        m: &Tensor,
        v: &Tensor,
        [decay, step, inv_bc2, eps]: [f64; 4],
    ) -> Result<Tensor> {
        let part = AdamPart::Update {
            decay: F64Bits::new(decay),
            step: F64Bits::new(step),
            inv_bc2: F64Bits::new(inv_bc2),
            eps: F64Bits::new(eps),
        };
        dispatch(part.into(), &[self, m, v])
    }
}
