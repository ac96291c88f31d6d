//! The precision of f32 matrix products on the device, chosen per process with
//! `CudaRuntime::set_matmul_precision`: plain f32, TF32 tensor cores (f32 in and out), or bf16
//! inputs with f32 accumulation and output. `gemm` runs every float product through
//! `cublasGemmStridedBatchedEx` with either operand transposed by cuBLAS's operation flags (no
//! copies). The bf16 copy of an f32 piece is made once per device block and kept beside it
//! (blocks are immutable once a piece holds them), so a weight or activation used by several
//! products is converted once. bf16 and f16 pieces are multiplied as they are (16-bit inputs
//! and output, f32 accumulation).

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use oxiflow_dtype::DType;

use super::kernels::{grid, launch, Kernel};
use super::storage::CudaStorage;
use super::{derr, Block, CudaRuntime};
use crate::Result;

/// How f32 matrix products run on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulPrecision {
    /// f32 inputs, f32 accumulation (the default; equal to the CPU up to summation order).
    #[default]
    F32,
    /// f32 inputs and outputs on TF32 tensor cores (inputs rounded to 10 mantissa bits).
    Tf32,
    /// Inputs rounded to bf16 (nearest even), f32 accumulation and output.
    Bf16,
}

impl MatmulPrecision {
    pub(crate) fn code(self) -> u8 {
        match self {
            MatmulPrecision::F32 => 0,
            MatmulPrecision::Tf32 => 1,
            MatmulPrecision::Bf16 => 2,
        }
    }
    pub(crate) fn from_code(c: u8) -> MatmulPrecision {
        match c {
            1 => MatmulPrecision::Tf32,
            2 => MatmulPrecision::Bf16,
            _ => MatmulPrecision::F32,
        }
    }
}

/// The bf16 copy (round to nearest even) of the f32 piece `x`, made on first use and kept with
/// its block.
fn bf16_of(rt: &std::sync::Arc<CudaRuntime>, op: &'static str, x: &CudaStorage) -> Result<u64> {
    x.block.bf16_shadow(|| {
        let n = x.block.bytes() / 4;
        let out = Block::alloc(rt, n.max(1) * 2)?;
        let (nn, xp, yp) = (n as i64, x.ptr(), out.ptr());
        launch!(rt, op, Kernel::F32ToBf16, grid(n); nn, xp, yp)?;
        Ok(out)
    })
}

/// One (batched) row-major product `out[i] = op(a[i]) op(b[i])`, `out[i]` `[m, n]`:
/// a stored `[m, k]`, or `[k, m]` with `ta`; b stored `[k, n]`, or `[n, k]` with `tb`.
/// Strides are in elements between batch entries (0: shared).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub ta: bool,
    pub tb: bool,
    pub strides: (i64, i64, i64),
}

fn flag(t: bool) -> cublasOperation_t {
    if t {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// Runs `g` on float pieces `a`, `b` into `out` (all of one float dtype): f32 at the runtime's
/// precision, f64, or bf16/f16 in and out with f32 accumulation.
pub(crate) fn gemm(
    rt: &std::sync::Arc<CudaRuntime>,
    op: &'static str,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
    g: Gemm,
) -> Result<()> {
    let dims = [g.m, g.n, g.k, g.batch];
    if dims.iter().any(|&d| d > i32::MAX as usize) {
        return Err(derr(
            op,
            format!("gemm sizes {dims:?} exceed cuBLAS's int range"),
        ));
    }
    let (m, n, k) = (g.m as i32, g.n as i32, g.k as i32);
    let (sa, sb, sc) = g.strides;
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS's first operand
    // is b's storage (n x k column-major when not transposed), its second a's.
    let (lda, ldb) = (if g.tb { k } else { n }, if g.ta { m } else { k });
    let precision = rt.matmul_precision();
    let (ty, compute, a_ptr, b_ptr) = match (out.dtype, precision) {
        (DType::F64, _) => (
            cudaDataType_t::CUDA_R_64F,
            cublasComputeType_t::CUBLAS_COMPUTE_64F,
            a.ptr(),
            b.ptr(),
        ),
        // 16-bit pieces go in directly; the precision setting is about f32 products.
        (DType::BF16, _) => (
            cudaDataType_t::CUDA_R_16BF,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            a.ptr(),
            b.ptr(),
        ),
        (DType::F16, _) => (
            cudaDataType_t::CUDA_R_16F,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            a.ptr(),
            b.ptr(),
        ),
        (_, MatmulPrecision::Bf16) => (
            cudaDataType_t::CUDA_R_16BF,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            bf16_of(rt, op, a)?,
            bf16_of(rt, op, b)?,
        ),
        (_, MatmulPrecision::Tf32) => (
            cudaDataType_t::CUDA_R_32F,
            cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            a.ptr(),
            b.ptr(),
        ),
        (_, MatmulPrecision::F32) => (
            cudaDataType_t::CUDA_R_32F,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            a.ptr(),
            b.ptr(),
        ),
    };
    let out_ty = match out.dtype {
        DType::F64 => cudaDataType_t::CUDA_R_64F,
        DType::BF16 | DType::F16 => ty,
        _ => cudaDataType_t::CUDA_R_32F,
    };
    let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
    let (alpha, beta) = if out.dtype == DType::F64 {
        (
            &one64 as *const f64 as *const _,
            &zero64 as *const f64 as *const _,
        )
    } else {
        (
            &one32 as *const f32 as *const _,
            &zero32 as *const f32 as *const _,
        )
    };
    rt.with_blas(op, |h| {
        // SAFETY: a, b (or their bf16 copies, same element order) and out are live device
        // blocks of the sizes the dims, leading dimensions and strides describe; alpha and beta
        // point to scalars of the compute type's scale type (f32 for the 32F types, f64 for
        // 64F) that outlive the call.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *h.handle(),
                flag(g.tb),
                flag(g.ta),
                n,
                m,
                k,
                alpha,
                b_ptr as *const _,
                ty,
                lda,
                sb,
                a_ptr as *const _,
                ty,
                ldb,
                sa,
                beta,
                out.ptr() as *mut _,
                out_ty,
                n,
                sc,
                g.batch as i32,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| derr(op, format!("cuBLAS gemm ({precision:?}, {g:?}): {e}")))
    })
}
