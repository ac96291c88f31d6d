//! Matrix products on the device, f32 ones at the precision their op carries
//! ([`MatmulPrecision`], a [`Gemm`]'s field): plain f32, TF32 tensor cores (f32 in and out), or
//! bf16 inputs with f32 accumulation and output. `gemm` runs every float product through
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
use super::{derr, Block, CudaRuntime, MatmulPrecision};
use oxiflow_tensor::Result;

/// The bf16 copy (round to nearest even) of the f32 piece `x`, made on first use and kept with
/// its block.
fn bf16_of(rt: &std::sync::Arc<CudaRuntime>, op: &'static str, x: &CudaStorage) -> Result<u64> {
    let n = x.numel();
    x.block.bf16_shadow(x.offset, n, || {
        let out = Block::alloc(rt, n.max(1) * 2)?;
        let (nn, xp, yp) = (n as i64, x.ptr(), out.ptr());
        launch!(rt, op, Kernel::F32ToBf16, grid(n); nn, xp, yp)?;
        Ok(out)
    })
}

/// One (batched) row-major product `out[i] = op(a[i]) op(b[i])`, `out[i]` `[m, n]`:
/// a stored `[m, k]`, or `[k, m]` with `ta`; b stored `[k, n]`, or `[n, k]` with `tb`.
/// Strides are in elements between batch entries (0: shared); f32 operands multiply at
/// `precision` (other dtypes as they are).
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub ta: bool,
    pub tb: bool,
    pub strides: (i64, i64, i64),
    pub precision: MatmulPrecision,
}

fn flag(t: bool) -> cublasOperation_t {
    if t {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// One operand of a product: `piece`'s elements from `offset` on, as rows `ld` elements apart
/// (a view of a larger array, such as one head of a `[B, T, H, D]` piece).
#[derive(Clone, Copy, Debug)]
pub struct Operand<'a> {
    pub piece: &'a CudaStorage,
    pub offset: usize,
    pub ld: usize,
}

impl Operand<'_> {
    /// A typed error unless `batch` entries `stride` apart of `[rows, cols]` rows lie inside
    /// the piece.
    fn check(
        &self,
        op: &'static str,
        what: &str,
        batch: usize,
        stride: i64,
        (rows, cols): (usize, usize),
    ) -> Result<()> {
        let numel = self.piece.numel() as u128;
        let fits = stride >= 0
            && self.ld >= cols
            && (batch == 0
                || rows == 0
                || cols == 0
                || self.offset as u128
                    + (batch as u128 - 1) * stride as u128
                    + (rows as u128 - 1) * self.ld as u128
                    + cols as u128
                    <= numel);
        if fits {
            Ok(())
        } else {
            Err(derr(
                op,
                format!(
                    "gemm operand {what}: {batch} x [{rows}, {cols}] rows {} apart, entries \
                     {stride} apart from element {} overrun its {} {}",
                    self.ld, self.offset, self.piece.dtype, self.piece.shape
                ),
            ))
        }
    }
}

/// Runs `g` on float pieces `a`, `b` into `out` (all of one float dtype, each packed row-major):
/// f32 at `g`'s precision, f64, or bf16/f16 in and out with f32 accumulation.
pub(crate) fn gemm(
    rt: &std::sync::Arc<CudaRuntime>,
    op: &'static str,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
    g: Gemm,
) -> Result<()> {
    let at = |piece, ld| Operand {
        piece,
        offset: 0,
        ld,
    };
    let (lda, ldb) = (if g.ta { g.m } else { g.k }, if g.tb { g.k } else { g.n });
    gemm_at(rt, op, at(a, lda), at(b, ldb), at(out, g.n), g)
}

/// [`gemm`] on operand views (each checked to lie inside its piece).
pub fn gemm_at(
    rt: &std::sync::Arc<CudaRuntime>,
    op: &'static str,
    a: Operand<'_>,
    b: Operand<'_>,
    out: Operand<'_>,
    g: Gemm,
) -> Result<()> {
    let dims = [g.m, g.n, g.k, g.batch, a.ld, b.ld, out.ld];
    if dims.iter().any(|&d| d > i32::MAX as usize) {
        return Err(derr(
            op,
            format!("gemm sizes {dims:?} exceed cuBLAS's int range"),
        ));
    }
    let (sa, sb, sc) = g.strides;
    a.check(
        op,
        "a",
        g.batch,
        sa,
        if g.ta { (g.k, g.m) } else { (g.m, g.k) },
    )?;
    b.check(
        op,
        "b",
        g.batch,
        sb,
        if g.tb { (g.n, g.k) } else { (g.k, g.n) },
    )?;
    out.check(op, "out", g.batch, sc, (g.m, g.n))?;
    let (m, n, k) = (g.m as i32, g.n as i32, g.k as i32);
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS's first operand
    // is b's storage (n x k column-major when not transposed), its second a's; a row-major
    // array's row stride is its column-major leading dimension.
    let (ld_first, ld_second, ld_out) =
        (b.ld.max(1) as i32, a.ld.max(1) as i32, out.ld.max(1) as i32);
    let precision = g.precision;
    let (a_piece, b_piece, out_piece) = (a.piece, b.piece, out.piece);
    let (ty, compute, a_ptr, b_ptr, in_size) = match (out_piece.dtype, precision) {
        (DType::F64, _) => (
            cudaDataType_t::CUDA_R_64F,
            cublasComputeType_t::CUBLAS_COMPUTE_64F,
            a_piece.ptr(),
            b_piece.ptr(),
            8,
        ),
        // 16-bit pieces go in directly; the precision setting is about f32 products.
        (DType::BF16, _) => (
            cudaDataType_t::CUDA_R_16BF,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            a_piece.ptr(),
            b_piece.ptr(),
            2,
        ),
        (DType::F16, _) => (
            cudaDataType_t::CUDA_R_16F,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            a_piece.ptr(),
            b_piece.ptr(),
            2,
        ),
        (_, MatmulPrecision::Bf16) => (
            cudaDataType_t::CUDA_R_16BF,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            bf16_of(rt, op, a_piece)?,
            bf16_of(rt, op, b_piece)?,
            2,
        ),
        (_, MatmulPrecision::Tf32) => (
            cudaDataType_t::CUDA_R_32F,
            cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            a_piece.ptr(),
            b_piece.ptr(),
            4,
        ),
        (_, MatmulPrecision::F32) => (
            cudaDataType_t::CUDA_R_32F,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            a_piece.ptr(),
            b_piece.ptr(),
            4,
        ),
    };
    let (a_ptr, b_ptr) = (
        a_ptr + (a.offset * in_size) as u64,
        b_ptr + (b.offset * in_size) as u64,
    );
    let out_ptr = out_piece.ptr() + (out.offset * out_piece.dtype.size()) as u64;
    let out_ty = match out_piece.dtype {
        DType::F64 => cudaDataType_t::CUDA_R_64F,
        DType::BF16 | DType::F16 => ty,
        _ => cudaDataType_t::CUDA_R_32F,
    };
    let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
    let (alpha, beta) = if out_piece.dtype == DType::F64 {
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
        // blocks holding every element the offsets, dims, leading dimensions and strides
        // address (checked above); alpha and beta
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
                ld_first,
                sb,
                a_ptr as *const _,
                ty,
                ld_second,
                sa,
                beta,
                out_ptr as *mut _,
                out_ty,
                ld_out,
                sc,
                g.batch as i32,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| derr(op, format!("cuBLAS gemm ({precision:?}, {g:?}): {e}")))
    })
}
