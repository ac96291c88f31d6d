//! `SwiGluPairs`: SwiGLU of one packed input `[.., F, 2]` (each gate value beside its up value)
//! -> `[.., F]`: what a fused gate/up product gives with its columns interleaved, so that a
//! split of F over the tensor-parallel axis (the product's output columns in contiguous
//! blocks) keeps each rank's pairs whole. Decoding uses it; it has no gradient.

use std::sync::LazyLock;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, Extern, ExternOp, Inferred, Kernels, MetaError, MetaResult, Result, Tensor,
};

use super::{cpu, cuda, SwiGluPairs};
use crate::op_signature::{kernels_without_gradient, op_signature};
use crate::operand_dtypes::{float_kernels, one_float_dtype};

static PAIRS: LazyLock<Kernels> =
    LazyLock::new(|| float_kernels::<SwiGluPairs>(cpu::pairs, cuda::pairs));

/// `silu(x[.., :, 0]) * x[.., :, 1]` for x `[.., F, 2]` -> `[.., F]` (one float dtype; local
/// or global alike).
pub fn swiglu_pairs(x: &Tensor) -> Result<Tensor> {
    dispatch(Extern::new(SwiGluPairs).into(), &[x])
}

impl ExternOp for SwiGluPairs {
    op_signature!("swiglu_pairs", 1);
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = one_float_dtype(dtypes)?;
        let r = rules::swiglu_pairs(shapes[0], mode).map_err(MetaError::Shape)?;
        Ok(Inferred::new(r, dt))
    }
    kernels_without_gradient!(
        PAIRS,
        "the packed SwiGLU serves decoding, which runs without gradients"
    );
}
