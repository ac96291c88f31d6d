//! AdamW as fused ops: [`AdamPart`], one element-wise pass of an update (the two moments and
//! the new value, each reading its same-shape float operands once), and [`AdamWMulti`], one
//! op updating every tensor of an optimizer step on this rank's pieces ([`adamw_multi`] and
//! its clipped and guarded forms). Neither has a gradient.
//!
//! Layouts: a pass splits its operands alike or takes them whole (`oxiflow_sbp::rules::
//! pointwise`, non-linear in every operand); the multi-tensor op computes global operands whole
//! (`rules::whole`), its layout-keeping path being [`adamw_multi`] on local pieces. Kernels:
//! CPU in f32 and f64 (16-bit data computed in f32, rounded once), CUDA in f32, f64, bf16 and
//! f16 (the library's `adam` template and its
//! single-launch multi-tensor kernel); any other backend or dtype is `TensorError::NoKernel` on
//! every rank before anything runs.

mod cpu;
mod cuda;
mod multi;
mod part;
mod step;

use std::sync::LazyLock;

use crate::op_signature::kernels_without_gradient;
use crate::operand_dtypes::kernels_for;
use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, Extern, ExternOp, F64Bits, Inferred, Kernels, MetaResult, Result, Tensor,
};

pub use multi::{AdamWClip, AdamWHyper, AdamWMulti, AdamWReuse, AdamWSlot, AdamWUpdated};
pub use part::AdamPart;
pub use step::{adamw_multi, adamw_multi_by, adamw_multi_clipped, adamw_multi_guarded};

/// The dtypes of the kernels, on the CPU (16-bit data through f32) and on CUDA.
const DTYPES: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16];

/// AdamW's moment update of `x` in one pass: `a x + b g` (`squared`: `a x + b g^2`).
pub fn adam_moment(x: &Tensor, g: &Tensor, a: f64, b: f64, squared: bool) -> Result<Tensor> {
    let (a, b) = (F64Bits::new(a), F64Bits::new(b));
    let part = if squared {
        AdamPart::Moment2 { a, b }
    } else {
        AdamPart::Moment1 { a, b }
    };
    dispatch(Extern::new(part).into(), &[x, g])
}

/// AdamW's new value of `p` in one pass: `decay p - (step m) / (sqrt(inv_bc2 v) + eps)`.
pub fn adam_update(
    p: &Tensor,
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
    dispatch(Extern::new(part).into(), &[p, m, v])
}

static PASS: LazyLock<Kernels> =
    LazyLock::new(|| kernels_for::<AdamPart>(DTYPES, cpu::pass, cuda::pass));

static MULTI: LazyLock<Kernels> =
    LazyLock::new(|| kernels_for::<AdamWMulti>(DTYPES, cpu::multi, cuda::multi));

const NO_GRADIENT: &str = "an optimizer update has no gradient";

impl ExternOp for AdamPart {
    fn name(&self) -> &'static str {
        self.op_name()
    }
    fn attrs(&self, key: &mut Vec<u8>) {
        self.key(key)
    }
    fn arity(&self) -> (usize, usize) {
        (self.operands(), self.operands())
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        self.meta(s, d, mode)
    }
    kernels_without_gradient!(PASS, NO_GRADIENT);
}

impl ExternOp for AdamWMulti {
    fn name(&self) -> &'static str {
        "adamw_multi"
    }
    fn attrs(&self, key: &mut Vec<u8>) {
        self.key(key)
    }
    fn arity(&self) -> (usize, usize) {
        let n = self.operands();
        (n.max(1), n.max(1))
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        self.meta(s, d, mode)
    }
    kernels_without_gradient!(MULTI, NO_GRADIENT);
}
