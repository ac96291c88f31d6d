//! The precision of f32 matrix products on the device: plain f32 (`sgemm`), or bf16 inputs
//! with f32 accumulation and output (tensor cores; `cublasGemmStridedBatchedEx`), chosen per
//! process with `CudaRuntime::set_matmul_precision`.

use cudarc::cublas::sys::{
    cublasComputeType_t::CUBLAS_COMPUTE_32F, cublasGemmAlgo_t, cublasOperation_t::CUBLAS_OP_N,
    cudaDataType_t::CUDA_R_16BF, cudaDataType_t::CUDA_R_32F,
};

use super::kernels::{grid, launch};
use super::storage::CudaStorage;
use super::{derr, Block, CudaRuntime};
use crate::Result;

/// How f32 matrix products run on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulPrecision {
    /// f32 inputs, f32 accumulation (the default; equal to the CPU up to summation order).
    #[default]
    F32,
    /// Inputs rounded to bf16 (nearest even), f32 accumulation and output.
    Bf16,
}

/// A bf16 copy (round to nearest even) of the f32 piece `x`.
fn to_bf16(rt: &std::sync::Arc<CudaRuntime>, op: &'static str, x: &CudaStorage) -> Result<Block> {
    let n = x.numel();
    let out = Block::alloc(rt, n.max(1) * 2)?;
    let (nn, xp, yp) = (n as i64, x.ptr(), out.ptr());
    launch!(rt, op, "f32_to_bf16", grid(n); nn, xp, yp)?;
    Ok(out)
}

/// Row-major `out[batch] = a[batch] b[batch or shared]` of f32 pieces with bf16 inputs and f32
/// accumulation; `(sa, sb, sc)` are the batch strides in elements (`sb` 0 for a shared b).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_bf16(
    rt: &std::sync::Arc<CudaRuntime>,
    op: &'static str,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
    [batch, m, k, n]: [usize; 4],
    (sa, sb, sc): (i64, i64, i64),
) -> Result<()> {
    let (ah, bh) = (to_bf16(rt, op, a)?, to_bf16(rt, op, b)?);
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    rt.with_blas(op, |h| {
        let (one, zero) = (1.0f32, 0.0f32);
        // Row-major C = A B is column-major C^T = B^T A^T: gemm(n, m, k, B, A).
        // SAFETY: bf16 copies of a and b and the f32 output are live device blocks of the
        // sizes the strides describe; alpha and beta are f32 for CUBLAS_COMPUTE_32F.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *h.handle(),
                CUBLAS_OP_N,
                CUBLAS_OP_N,
                ni,
                mi,
                ki,
                &one as *const f32 as *const _,
                bh.ptr() as *const _,
                CUDA_R_16BF,
                ni,
                sb,
                ah.ptr() as *const _,
                CUDA_R_16BF,
                ki,
                sa,
                &zero as *const f32 as *const _,
                out.ptr() as *mut _,
                CUDA_R_32F,
                ni,
                sc,
                batch as i32,
                CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| derr(op, format!("cuBLAS bf16 gemm: {e}")))
    })
}
