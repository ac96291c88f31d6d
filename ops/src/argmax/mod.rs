//! The index of the largest element along the last dim (`[.., N]` -> i64 `[..]`), as greedy
//! decoding picks the next token: the first index of the largest value, where an element counts
//! only when it is above negative infinity (NaN never wins), and index 0 when none does — the
//! host's `>`-scan from `(0, -inf)` exactly, so a device pick equals a host one.
//!
//! Layouts (`oxiflow_sbp::rules::arg_reduce`): rows split on any leading dim, or broadcast; a
//! split of the searched dim is gathered first. Kernels: CPU and CUDA (a block per row) in f32,
//! f64, bf16 and f16. Not differentiable.

mod cpu;
mod cuda;

use std::sync::LazyLock;

use crate::op_signature::{kernels_without_gradient, op_signature};
use crate::operand_dtypes::kernels_for;
use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, Extern, ExternOp, Inferred, Kernels, MetaError, MetaResult, Result, Tensor,
};

/// The arg-max over the last dim (input: x).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgMax;

/// The first index of the largest element of each row of x's last dim (see the module docs),
/// as i64 of x's shape without that dim.
pub fn argmax(x: &Tensor) -> Result<Tensor> {
    dispatch(Extern::new(ArgMax).into(), &[x])
}

const DTYPES: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16];

static KERNELS: LazyLock<Kernels> =
    LazyLock::new(|| kernels_for::<ArgMax>(DTYPES, cpu::argmax, cuda::argmax));

impl ExternOp for ArgMax {
    op_signature!("argmax", 1);
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let x = shapes[0];
        if !dtypes[0].is_float() {
            return Err(MetaError::DType(format!(
                "the input must be a float dtype, got {}",
                dtypes[0]
            )));
        }
        if x.ndim() == 0 || x.dim(x.ndim() - 1) == 0 {
            return Err(MetaError::Shape(format!(
                "needs a last dim with at least one element, got {x}"
            )));
        }
        let r = rules::arg_reduce(x.ndim() - 1, x, mode).map_err(MetaError::Shape)?;
        Ok(Inferred::new(r, DType::I64))
    }
    kernels_without_gradient!(KERNELS, "an index has no gradient");
}
