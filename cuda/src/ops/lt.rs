//! The CUDA backend's cuBLASLt entry for kernels composing products (the fused linear layers,
//! the fused linear cross-entropy): which float type a dtype's product takes at a matmul
//! precision, and a product that says when cuBLASLt does not serve a call so the caller
//! composes.

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_tensor::Result;

use crate::blaslt::{lt_matmul_c, LtMatmul};
use crate::ops::CudaKernels;
use crate::raw::FloatType;

impl CudaKernels {
    /// The cuBLASLt product's float type and whether it runs on TF32 tensor cores, when
    /// cuBLASLt serves pieces of `dt` at `precision` (None: the composed kernels).
    pub fn lt_types(&self, dt: DType, precision: MatmulPrecision) -> Option<(FloatType, bool)> {
        let t = FloatType::of(dt)?;
        match (t, precision) {
            (FloatType::F32, MatmulPrecision::F32) => Some((t, false)),
            (FloatType::F32, MatmulPrecision::Tf32) => Some((t, true)),
            (FloatType::F32, MatmulPrecision::Bf16) => None,
            _ => Some((t, false)),
        }
    }

    /// Runs `g` on cuBLASLt: `Ok(true)` when it ran, `Ok(false)` when cuBLASLt does not serve
    /// the call (the caller composes), else its error.
    pub fn lt_ran(&self, g: &LtMatmul, a: u64, b: u64, out: u64) -> Result<bool> {
        self.lt_ran_c(g, a, b, out, out)
    }

    /// [`Self::lt_ran`] reading the C operand of a nonzero `beta` from `c` (laid out as `out`).
    pub fn lt_ran_c(&self, g: &LtMatmul, a: u64, b: u64, c: u64, out: u64) -> Result<bool> {
        match lt_matmul_c(&self.rt, g, a, b, c, out) {
            Ok(()) => Ok(true),
            Err(e) if e.is_fallback() => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}
