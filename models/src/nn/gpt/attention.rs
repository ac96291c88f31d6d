//! Causal multi-head self-attention, Megatron style on a mesh: Q, K and V column-parallel (each
//! rank holds whole heads), the output projection row-parallel.

use crate::{Result, TensorError};
use oxiflow_tensor::Tensor;

use super::super::linear::{Linear, Parallel};
use super::super::param::{Module, Parameter};
use super::config::{GptConfig, GptLayout, TP_AXIS};

/// Causal scaled-dot-product attention on the heads layout of the projections: q, k, v
/// `[B, T, H, D]` -> `[B, T, H, D]`, softmax(q k^T / sqrt(D) + mask) v, by the fused
/// `flash_attention` op (no `[T, T]` probabilities kept: the backward recomputes them from the
/// saved log-sum-exp). Batch and heads may be split; the softmax runs over each rank's own
/// heads.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    if q.ndim() != 4 || k.shape() != q.shape() || v.shape() != q.shape() {
        return Err(TensorError::Shape {
            op: "causal_attention",
            shapes: format!("{}, {}, {}", q.shape(), k.shape(), v.shape()),
            sbps: format!("{:?}, {:?}, {:?}", q.nd_sbp(), k.nd_sbp(), v.nd_sbp()),
            detail: "q, k and v must be [B, T, H, D] of one shape".into(),
        });
    }
    let d = q.shape().dim(3);
    q.flash_attention(k, v, true, 1.0 / (d.max(1) as f64).sqrt())
}

/// Q, K, V projections `name.{q,k,v}` and the output projection `name.proj`, all `[C, C]`.
#[derive(Clone, Debug)]
pub struct CausalSelfAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub proj: Linear,
    heads: usize,
}

impl CausalSelfAttention {
    pub fn new(name: &str, cfg: &GptConfig, layout: &GptLayout) -> Result<CausalSelfAttention> {
        let c = cfg.width;
        let column = layout.linear(cfg, Parallel::Column(TP_AXIS));
        let row = layout.linear(cfg, Parallel::Row(TP_AXIS));
        Ok(CausalSelfAttention {
            q: Linear::new(&format!("{name}.q"), c, c, &column)?,
            k: Linear::new(&format!("{name}.k"), c, c, &column)?,
            v: Linear::new(&format!("{name}.v"), c, c, &column)?,
            proj: Linear::new(&format!("{name}.proj"), c, c, &row)?,
            heads: cfg.heads,
        })
    }

    /// x `[B, T, C]` (whole on the tensor-parallel axis) -> the attended values `[B, T, C]`
    /// before the output projection, heads merged (split on the tensor-parallel axis).
    pub fn attend(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = (x.shape().dim(0), x.shape().dim(1), x.shape().dim(2));
        let h = self.heads;
        let heads = |y: Tensor| y.reshape([b, t, h, c / h]);
        let q = heads(self.q.forward(x)?)?;
        let k = heads(self.k.forward(x)?)?;
        let v = heads(self.v.forward(x)?)?;
        causal_attention(&q, &k, &v)?.reshape([b, t, c])
    }
}

impl Module for CausalSelfAttention {
    fn parameters(&self) -> Vec<Parameter> {
        [&self.q, &self.k, &self.v, &self.proj]
            .iter()
            .flat_map(|l| l.parameters())
            .collect()
    }
}
