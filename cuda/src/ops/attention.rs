//! Attention probabilities on CUDA, written into the executor's output piece: scores `q k^T` by
//! cuBLAS (k transposed by the gemm flag) into scratch from the runtime's pool, then the
//! scaled, optionally causal row softmax kernel (when the op's products are bf16 it also writes
//! the probabilities' bf16 copy, which the next product reads).

use oxiflow_sbp::Shape;

use super::super::kernels::{launch, per_row, Kernel, Template};
use super::super::storage::CudaStorage;
use super::super::{derr, Block, MatmulPrecision};
use super::{float_only, CudaKernels};
use oxiflow_dtype::DType;
use oxiflow_tensor::backend::AttentionKernels;
use oxiflow_tensor::Result;
use oxiflow_tensor::{KernelBackend, OutSpec};

impl CudaKernels {
    /// The probabilities `[B, H, T, S]` of q `[B, H, T, D]` and k `[B, H, S, D]` into `p`.
    fn probs(
        &self,
        op: &'static str,
        q: &CudaStorage,
        k: &CudaStorage,
        (causal, scale, precision): (bool, f64, MatmulPrecision),
        p: &CudaStorage,
    ) -> Result<()> {
        float_only(op, q.dtype)?;
        let (qd, kd) = (q.shape.dims(), k.shape.dims());
        let fits = qd.len() == 4
            && kd.len() == 4
            && k.dtype == q.dtype
            && (qd[0], qd[1], qd[3]) == (kd[0], kd[1], kd[3])
            && (!causal || qd[2] == kd[2]);
        if !fits {
            return Err(derr(
                op,
                format!(
                    "k {} {} does not fit q {} {}",
                    k.dtype, k.shape, q.dtype, q.shape
                ),
            ));
        }
        let (t, s) = (qd[2], kd[2]);
        let spec = OutSpec {
            shape: Shape::new([qd[0], qd[1], t, s]),
            dtype: q.dtype,
        };
        if p.shape != spec.shape || p.dtype != spec.dtype {
            return Err(derr(
                op,
                format!(
                    "output {} {} for probabilities {}",
                    p.dtype, p.shape, spec.shape
                ),
            ));
        }
        let rows = qd[0]
            .checked_mul(qd[1])
            .and_then(|n| n.checked_mul(t))
            .filter(|_| spec.shape.checked_numel().is_some())
            .ok_or_else(|| derr(op, format!("scores {} overflow", spec.shape)))?;
        // The scores are scratch; the softmax writes the probabilities into `p`.
        let scores = self.alloc(&spec)?;
        self.product_t(op, q, k, (false, true), true, precision, &scores)?;
        if rows > 0 {
            let rt = &self.rt;
            let (r, tt, ss, sc, c) = (rows as i64, t as i64, s as i64, scale, causal as i32);
            let (xp, yp) = (scores.ptr(), p.ptr());
            if q.dtype == DType::F32 && precision == MatmulPrecision::Bf16 {
                // The probabilities feed bf16 products: their bf16 copy comes with them.
                let h = Block::alloc(rt, p.numel() * 2)?;
                let hp = h.ptr();
                launch!(rt, op, Kernel::AttnSoftmaxBf16, per_row(rows); r, tt, ss, sc, c, xp, yp, hp)?;
                p.block.set_bf16_shadow(h);
            } else {
                launch!(rt, op, Template::AttnSoftmax.at(q.dtype), per_row(rows); r, tt, ss, sc, c, xp, yp)?;
            }
        }
        Ok(())
    }
}

impl AttentionKernels for CudaKernels {
    fn attention_probs(
        &self,
        q: &CudaStorage,
        k: &CudaStorage,
        causal: bool,
        scale: f64,
        precision: MatmulPrecision,
        out: &mut CudaStorage,
    ) -> Result<()> {
        self.probs("attention_probs", q, k, (causal, scale, precision), out)
    }
}
