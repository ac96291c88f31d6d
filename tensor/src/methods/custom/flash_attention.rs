//! The `Tensor` methods of the custom op `op/custom/flash_attention.rs`: they build its
//! ops and dispatch them.

use oxiflow_dtype::MatmulPrecision;

use crate::dispatch::dispatch_multi;
use crate::op::custom::{FlashAttention, FlashAttrs};
use crate::op::F64Bits;
use crate::tensor::Tensor;
use crate::{Result, TensorError};

impl Tensor {
    /// Fused attention on heads-last operands: queries `self` `[B, T, H, D]`, keys `k`
    /// `[B, S, G, D]`, values `v` `[B, S, G, Dv]` (H a multiple of G: query head `h` reads
    /// key/value head `h / (H / G)`) give `softmax(scale q k^T [+ causal mask]) v`
    /// `[B, T, H, Dv]` (with `causal`, S == T and query `i` attends to keys `0..=i`). Never
    /// keeps a `[T, S]` array; the backward recomputes the probabilities from the log-sum-exp.
    pub fn flash_attention(
        &self,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
        scale: f64,
    ) -> Result<Tensor> {
        self.flash_attention_at(k, v, (causal, scale), MatmulPrecision::F32)
    }

    /// [`Tensor::flash_attention`] with `(causal, scale)` and f32 products at `precision` on
    /// a device.
    pub fn flash_attention_at(
        &self,
        k: &Tensor,
        v: &Tensor,
        attrs: (bool, f64),
        precision: MatmulPrecision,
    ) -> Result<Tensor> {
        Ok(self.flash_attention_lse_at(k, v, attrs, precision)?.0)
    }

    /// Fused attention on heads-first operands: queries `self` `[B, H, T, D]`, keys `k`
    /// `[B, G, S, D]`, values `v` `[B, G, S, Dv]` (grouped heads as above) give `softmax(scale q k^T [+ causal mask]) v`
    /// `[B, H, T, Dv]`: [`Tensor::flash_attention`] on the operands permuted to `[B, T, H, D]`
    /// (a batch or heads split moves with its dim). Never keeps a `[T, S]` array.
    pub fn attention(&self, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Result<Tensor> {
        for (what, x) in [("q", self), ("k", k), ("v", v)] {
            if x.ndim() != 4 {
                return Err(TensorError::Shape {
                    op: "attention",
                    shapes: format!("{}, {}, {}", self.shape(), k.shape(), v.shape()),
                    sbps: format!("{:?}, {:?}, {:?}", self.nd_sbp(), k.nd_sbp(), v.nd_sbp()),
                    detail: format!("{what} must be 4-d [B, H, T, D], got {}", x.shape()),
                });
            }
        }
        let heads_last = |x: &Tensor| x.permute(&[0, 2, 1, 3]);
        heads_last(self)?
            .flash_attention(&heads_last(k)?, &heads_last(v)?, causal, scale)?
            .permute(&[0, 2, 1, 3])
    }

    /// [`Tensor::flash_attention`] and the log-sum-exp of each row's masked, scaled scores
    /// `[B, H, T]` (f32 for 16-bit operands, else their dtype; -inf for a row without keys).
    pub fn flash_attention_lse(
        &self,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
        scale: f64,
    ) -> Result<(Tensor, Tensor)> {
        self.flash_attention_lse_at(k, v, (causal, scale), MatmulPrecision::F32)
    }

    /// [`Tensor::flash_attention_lse`] with `(causal, scale)` and f32 products at `precision`
    /// on a device.
    pub fn flash_attention_lse_at(
        &self,
        k: &Tensor,
        v: &Tensor,
        (causal, scale): (bool, f64),
        precision: MatmulPrecision,
    ) -> Result<(Tensor, Tensor)> {
        let attrs = FlashAttrs {
            causal,
            scale: F64Bits::new(scale),
            precision,
        };
        let outs = dispatch_multi(FlashAttention::Forward(attrs).into(), &[self, k, v])?;
        match <[Tensor; 2]>::try_from(outs) {
            Ok([o, lse]) => Ok((o, lse)),
            Err(v) => Err(TensorError::Kernel {
                op: "flash_attention",
                detail: format!("expected o and lse, got {} outputs", v.len()),
            }),
        }
    }
}
