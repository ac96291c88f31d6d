//! Scaled dot-product attention over `[B, H, T, D]` queries and `[B, H, S, D]` keys / `[B, H, S,
//! Dv]` values: `softmax(q k^T * scale + causal mask) v` as one op (the probabilities never leave
//! the rank's heads), and `attention_probs`, the softmax probabilities `[B, H, T, S]` alone. Both
//! split on batch or heads; the backward recomputes the probabilities and is written with ops.

use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Rules, Sbp, Shape};

use super::grad::Grad;
use super::{
    need_float, same_dtype, single, Backend, F64Bits, Inferred, KernelBackend, MetaError, OpFamily,
    Saves,
};
use crate::dispatch::dispatch;
use crate::tensor::Tensor;
use crate::Result;

/// The attention family. `Forward` inputs: (q, k, v); `Probs` inputs: (q, k).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AttentionOp {
    /// `softmax(q k^T * scale + mask) v` -> `[B, H, T, Dv]`.
    Forward { causal: bool, scale: F64Bits },
    /// `softmax(q k^T * scale + mask)` -> `[B, H, T, S]`.
    Probs { causal: bool, scale: F64Bits },
}

/// Attention kernels of a backend (float pieces of one dtype, shapes as `infer` checked: with
/// `causal`, query row `i` attends to key columns `0..=i`).
pub trait AttentionKernels: KernelBackend {
    fn attention(
        &self,
        q: &Self::Piece,
        k: &Self::Piece,
        v: &Self::Piece,
        causal: bool,
        scale: f64,
        out: &mut Self::Out,
    ) -> Result<()>;
    fn attention_probs(
        &self,
        q: &Self::Piece,
        k: &Self::Piece,
        causal: bool,
        scale: f64,
        out: &mut Self::Out,
    ) -> Result<()>;
}

/// Checks q `[B, H, T, D]`, k `[B, H, S, D]` and (when given) v `[B, H, S, Dv]`; returns the
/// output shape (`[B, H, T, Dv]`, or `[B, H, T, S]` without v).
fn out_shape(
    q: &Shape,
    k: &Shape,
    v: Option<&Shape>,
    causal: bool,
) -> std::result::Result<Shape, MetaError> {
    let four = |what: &str, s: &Shape, dims: &str| {
        if s.ndim() == 4 {
            Ok(())
        } else {
            Err(MetaError::Shape(format!(
                "{what} must be 4-d {dims}, got {s}"
            )))
        }
    };
    four("q", q, "[B, H, T, D]")?;
    four("k", k, "[B, H, S, D]")?;
    let (qd, kd) = (q.dims(), k.dims());
    if qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] {
        return Err(MetaError::Shape(format!(
            "k must be [B, H, S, D] for q [B, H, T, D] (same B, H, D), got q {q} and k {k}"
        )));
    }
    if causal && qd[2] != kd[2] {
        return Err(MetaError::Shape(format!(
            "causal attention needs as many keys as queries (S == T), got q {q} and k {k}"
        )));
    }
    match v {
        None => Ok(Shape::new([qd[0], qd[1], qd[2], kd[2]])),
        Some(v) => {
            four("v", v, "[B, H, S, Dv]")?;
            let vd = v.dims();
            if vd[..3] != kd[..3] {
                return Err(MetaError::Shape(format!(
                    "v must be [B, H, S, Dv] for k [B, H, S, D] (same B, H, S), got k {k} and v {v}"
                )));
            }
            Ok(Shape::new([qd[0], qd[1], qd[2], vd[3]]))
        }
    }
}

impl AttentionOp {
    fn attrs(&self) -> (bool, f64) {
        match self {
            AttentionOp::Forward { causal, scale } | AttentionOp::Probs { causal, scale } => {
                (*causal, scale.get())
            }
        }
    }
}

impl OpFamily for AttentionOp {
    fn name(&self) -> &'static str {
        match self {
            AttentionOp::Forward { .. } => "attention",
            AttentionOp::Probs { .. } => "attention_probs",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            AttentionOp::Forward { .. } => (3, 3),
            AttentionOp::Probs { .. } => (2, 2),
        }
    }

    fn infer(
        &self,
        s: &[&Shape],
        d: &[DType],
        mode: RuleMode,
    ) -> std::result::Result<Inferred, MetaError> {
        let dt = same_dtype(d)?;
        need_float(dt, "q, k and v")?;
        let (causal, scale) = self.attrs();
        if !scale.is_finite() {
            return Err(MetaError::Shape(format!(
                "scale must be finite, got {scale}"
            )));
        }
        let out = out_shape(s[0], s[1], s.get(2).copied(), causal)?;
        // Batch split, heads split (every operand and the output alike), or all broadcast: the
        // softmax over keys stays within the rank's (batch, head) pairs. No P: not linear.
        let mut r = Rules::new(mode, [out]);
        for sbp in [Sbp::S(0), Sbp::S(1), Sbp::B] {
            r.push_uniform(s.len(), 1, sbp);
        }
        Ok(Inferred::new(r, dt))
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        let (causal, scale) = self.attrs();
        match self {
            AttentionOp::Forward { .. } => b.attention(x[0], x[1], x[2], causal, scale, y),
            AttentionOp::Probs { .. } => b.attention_probs(x[0], x[1], causal, scale, y),
        }
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            // The backward recomputes the probabilities from q and k.
            AttentionOp::Forward { .. } => Saves::inputs(&[0, 1, 2]),
            AttentionOp::Probs { .. } => Saves::inputs(&[0, 1]).and_outputs(&[0]),
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (causal, scale) = self.attrs();
        let (q, k, dy) = (g.input(0)?, g.input(1)?, g.dy()?);
        // With P = softmax(S), S = q k^T * scale: dS = softmax_backward(P, dP);
        // dq = dS k * scale, dk = dS^T q * scale (masked entries have P = 0, so dS = 0 there).
        let p = match self {
            AttentionOp::Forward { .. } => q.attention_probs(k, causal, scale)?,
            AttentionOp::Probs { .. } => g.output(0)?.clone(),
        };
        let ds = if g.need(0) || g.need(1) {
            let dp = match self {
                AttentionOp::Forward { .. } => dy.matmul_t(g.input(2)?, false, true)?,
                AttentionOp::Probs { .. } => dy.clone(),
            };
            Some(Tensor::softmax_backward(&p, &dp, -1)?)
        } else {
            None
        };
        let scaled = |t: Tensor| t.mul_scalar(scale);
        let mut grads = Vec::with_capacity(g.arity());
        grads.push(match &ds {
            Some(ds) if g.need(0) => Some(scaled(ds.bmm(k)?)?),
            _ => None,
        });
        grads.push(match &ds {
            Some(ds) if g.need(1) => Some(scaled(ds.matmul_t(q, true, false)?)?),
            _ => None,
        });
        if let AttentionOp::Forward { .. } = self {
            grads.push(g.when(2, || p.matmul_t(dy, true, false))?);
        }
        Ok(grads)
    }
}

impl Tensor {
    /// Scaled dot-product attention: `softmax(self k^T * scale + mask) v` for `self` (queries)
    /// `[B, H, T, D]`, `k` `[B, H, S, D]` and `v` `[B, H, S, Dv]`, giving `[B, H, T, Dv]`. With
    /// `causal` (needs S == T) query `i` attends to keys `0..=i` only.
    pub fn attention(&self, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Result<Tensor> {
        let scale = F64Bits::new(scale);
        dispatch(AttentionOp::Forward { causal, scale }.into(), &[self, k, v])
    }

    /// The attention probabilities `softmax(self k^T * scale + mask)`, `[B, H, T, S]`, for
    /// queries `self` `[B, H, T, D]` and keys `k` `[B, H, S, D]` (masked entries are 0).
    pub fn attention_probs(&self, k: &Tensor, causal: bool, scale: f64) -> Result<Tensor> {
        let scale = F64Bits::new(scale);
        dispatch(AttentionOp::Probs { causal, scale }.into(), &[self, k])
    }
}
