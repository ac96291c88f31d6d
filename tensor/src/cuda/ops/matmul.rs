//! Matmul CUDA kernels: cuBLAS strided-batched gemm for f32 (optionally bf16 inputs) and f64,
//! an NVRTC kernel for i64.

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
use oxiflow_collectives::DType;
use oxiflow_sbp::Shape;

use super::super::copy::fill;
use super::super::kernels::{grid, launch};
use super::super::precision::{gemm_bf16, MatmulPrecision};
use super::super::storage::CudaStorage;
use super::super::{derr, CudaRuntime};
use super::CudaKernels;
use crate::op::{MatmulKernels, OutSpec};
use crate::Result;

#[allow(clippy::too_many_arguments)]
fn matmul(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    a: &CudaStorage,
    b: &CudaStorage,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    out_shape: &Shape,
    b_batched: bool,
) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(rt, a.dtype, out_shape.clone())?;
    if batch * m * n == 0 {
        return Ok(out);
    }
    if k == 0 {
        fill(rt, op, a.dtype, out.ptr(), out.numel(), 0.0, 0)?;
        return Ok(out);
    }
    let (sa, sb, sc) = (
        (m * k) as i64,
        if b_batched { (k * n) as i64 } else { 0 },
        (m * n) as i64,
    );
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    match a.dtype {
        DType::I64 => {
            let (bt, m_, k_, n_, sbb, ap, bp, yp) = (
                batch as i64,
                m as i64,
                k as i64,
                n as i64,
                sb,
                a.ptr(),
                b.ptr(),
                out.ptr(),
            );
            launch!(rt, op, "matmul_i64", grid(batch * m * n); bt, m_, k_, n_, sbb, ap, bp, yp)?;
        }
        DType::F32 if rt.matmul_precision() == MatmulPrecision::Bf16 => {
            gemm_bf16(rt, op, a, b, &out, [batch, m, k, n], (sa, sb, sc))?
        }
        // Row-major C = A B is column-major C^T = B^T A^T: gemm(n, m, k, B, A).
        DType::F32 => rt.with_blas(op, |h| {
            let (one, zero) = (1.0f32, 0.0f32);
            // SAFETY: pointers are live device blocks of the sizes the strides describe.
            unsafe {
                cudarc::cublas::result::sgemm_strided_batched(
                    *h.handle(),
                    CUBLAS_OP_N,
                    CUBLAS_OP_N,
                    ni,
                    mi,
                    ki,
                    &one,
                    b.ptr() as *const f32,
                    ni,
                    sb,
                    a.ptr() as *const f32,
                    ki,
                    sa,
                    &zero,
                    out.ptr() as *mut f32,
                    ni,
                    sc,
                    batch as i32,
                )
            }
            .map_err(|e| derr(op, format!("cuBLAS sgemm: {e}")))
        })?,
        DType::F64 => rt.with_blas(op, |h| {
            let (one, zero) = (1.0f64, 0.0f64);
            // SAFETY: as above.
            unsafe {
                cudarc::cublas::result::dgemm_strided_batched(
                    *h.handle(),
                    CUBLAS_OP_N,
                    CUBLAS_OP_N,
                    ni,
                    mi,
                    ki,
                    &one,
                    b.ptr() as *const f64,
                    ni,
                    sb,
                    a.ptr() as *const f64,
                    ki,
                    sa,
                    &zero,
                    out.ptr() as *mut f64,
                    ni,
                    sc,
                    batch as i32,
                )
            }
            .map_err(|e| derr(op, format!("cuBLAS dgemm: {e}")))
        })?,
    }
    Ok(out)
}

impl MatmulKernels for CudaKernels {
    fn matmul(&self, a: &CudaStorage, b: &CudaStorage, out: &OutSpec) -> Result<CudaStorage> {
        let name = "matmul";
        let n = a.numel();
        let k = a.shape.dims().last().copied().unwrap_or(1);
        let bd = b.shape.dims();
        if bd.len() != 2 || bd[0] != k {
            return Err(derr(
                name,
                format!("local pieces {} and {} do not multiply", a.shape, b.shape),
            ));
        }
        let m = n
            .checked_div(k)
            .unwrap_or_else(|| out.shape.numel() / bd[1].max(1));
        matmul(&self.rt, name, a, b, 1, m, k, bd[1], &out.shape, false)
    }

    fn batch_matmul(&self, a: &CudaStorage, b: &CudaStorage, out: &OutSpec) -> Result<CudaStorage> {
        let name = "batch_matmul";
        let ad = a.shape.dims();
        let bd = b.shape.dims();
        if ad.len() < 2 || bd.len() != ad.len() || bd[ad.len() - 2] != ad[ad.len() - 1] {
            return Err(derr(
                name,
                format!("local pieces {} and {} do not multiply", a.shape, b.shape),
            ));
        }
        let r = ad.len();
        let batch: usize = ad[..r - 2].iter().product();
        matmul(
            &self.rt,
            name,
            a,
            b,
            batch,
            ad[r - 2],
            ad[r - 1],
            bd[r - 1],
            &out.shape,
            true,
        )
    }
}
