//! Attention on CUDA, composed: scores `q k^T` by cuBLAS (k transposed by the gemm flag),
//! the scaled, optionally causal row softmax kernel (under bf16 matrix products it also writes
//! the probabilities' bf16 copy), then the product with v by cuBLAS (the backend checks the
//! result against the expected output).

use oxiflow_sbp::Shape;

use super::super::kernels::{launch, per_row, Kernel, Template};
use super::super::storage::CudaStorage;
use super::super::{derr, Block, MatmulPrecision};
use super::{float_only, CudaKernels};
use crate::op::{AttentionKernels, MatmulKernels, OutSpec};
use crate::Result;
use oxiflow_dtype::DType;

impl CudaKernels {
    /// The probabilities `[B, H, T, S]` of q `[B, H, T, D]` and k `[B, H, S, D]`.
    fn probs(
        &self,
        op: &'static str,
        q: &CudaStorage,
        k: &CudaStorage,
        causal: bool,
        scale: f64,
    ) -> Result<CudaStorage> {
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
        let rows = qd[0]
            .checked_mul(qd[1])
            .and_then(|n| n.checked_mul(t))
            .filter(|_| spec.shape.checked_numel().is_some())
            .ok_or_else(|| derr(op, format!("scores {} overflow", spec.shape)))?;
        let scores = self.product_t(op, q, k, (false, true), true, &spec)?;
        let p = self.alloc(&spec)?;
        if rows > 0 {
            let rt = &self.rt;
            let (r, tt, ss, sc, c) = (rows as i64, t as i64, s as i64, scale, causal as i32);
            let (xp, yp) = (scores.ptr(), p.ptr());
            if q.dtype == DType::F32 && rt.matmul_precision() == MatmulPrecision::Bf16 {
                // The probabilities feed bf16 products: their bf16 copy comes with them.
                let h = Block::alloc(rt, p.numel() * 2)?;
                let hp = h.ptr();
                launch!(rt, op, Kernel::AttnSoftmaxBf16, per_row(rows); r, tt, ss, sc, c, xp, yp, hp)?;
                p.block.set_bf16_shadow(h);
            } else {
                launch!(rt, op, Template::AttnSoftmax.at(q.dtype), per_row(rows); r, tt, ss, sc, c, xp, yp)?;
            }
        }
        Ok(p)
    }
}

impl AttentionKernels for CudaKernels {
    fn attention(
        &self,
        q: &CudaStorage,
        k: &CudaStorage,
        v: &CudaStorage,
        causal: bool,
        scale: f64,
        _out: &OutSpec,
    ) -> Result<CudaStorage> {
        let op = "attention";
        let (kd, vd) = (k.shape.dims(), v.shape.dims());
        if vd.len() != 4 || kd.len() != 4 || vd[..3] != kd[..3] || v.dtype != k.dtype {
            return Err(derr(
                op,
                format!(
                    "v {} {} does not fit k {} {}",
                    v.dtype, v.shape, k.dtype, k.shape
                ),
            ));
        }
        let p = self.probs(op, q, k, causal, scale)?;
        let qd = q.shape.dims();
        let spec = OutSpec {
            shape: Shape::new([qd[0], qd[1], qd[2], vd[3]]),
            dtype: q.dtype,
        };
        self.batch_matmul(&p, v, &spec)
    }

    fn attention_probs(
        &self,
        q: &CudaStorage,
        k: &CudaStorage,
        causal: bool,
        scale: f64,
        _out: &OutSpec,
    ) -> Result<CudaStorage> {
        self.probs("attention_probs", q, k, causal, scale)
    }
}
