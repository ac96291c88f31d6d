//! The attention probabilities `softmax(q k^T * scale + causal mask)` `[B, H, T, S]` of queries
//! `[B, H, T, D]` and keys `[B, H, S, D]` as one op (the composed attention: with `bmm` by the
//! values it is the reference the fused op, `custom::flash_attention`, is checked against).
//! Split on batch or heads; the backward reads the probabilities and is written with ops. Its
//! products run at the op's [`MatmulPrecision`] (as the backward's do).

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    kernel_trait, name_and_arity, same_float_dtype, shape_rule, single, F64Bits, Inferred,
    MetaError, MetaResult, OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// `softmax(q k^T * scale + mask)` -> `[B, H, T, S]`; inputs (q, k).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AttentionOp {
    pub causal: bool,
    pub scale: F64Bits,
    pub precision: MatmulPrecision,
}

kernel_trait! {
    /// Attention kernels of a backend (float pieces of one dtype, shapes as `infer` checked: with
    /// `causal`, query row `i` attends to key columns `0..=i`).
    pub trait AttentionKernels {
        fn attention_probs(
            q: &Self::Piece,
            k: &Self::Piece,
            causal: bool,
            scale: f64,
            precision: MatmulPrecision,
        );
    }
}

impl OpFamily for AttentionOp {
    name_and_arity!("attention_probs", 2);

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = same_float_dtype(d, "q and k")?;
        let scale = self.scale.get();
        if !scale.is_finite() {
            return Err(MetaError::Shape(format!(
                "scale must be finite, got {scale}"
            )));
        }
        let r = shape_rule(rules::attention_probs(s[0], s[1], self.causal, mode))?;
        Ok(Inferred::new(r, dt))
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        Saves::inputs(&[0, 1]).and_outputs(&[0])
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (scale, mp) = (self.scale.get(), self.precision);
        let (q, k, p) = (g.input(0)?, g.input(1)?, g.output(0)?);
        // With P = softmax(S), S = q k^T * scale: dS = softmax_backward(P, dP); dq = dS k *
        // scale, dk = dS^T q * scale (masked entries have P = 0, so dS = 0 there).
        let ds = Tensor::softmax_backward_feeding(p, g.dy()?, -1, mp)?;
        Ok(vec![
            g.when(0, || ds.bmm_at(k, mp)?.mul_scalar(scale))?,
            g.when(1, || {
                ds.matmul_t_at(q, (true, false), mp)?.mul_scalar(scale)
            })?,
        ])
    }
}

impl<B: AttentionKernels> RunKernels<B> for AttentionOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        b.attention_probs(x[0], x[1], self.causal, self.scale.get(), self.precision, y)
    }
}
