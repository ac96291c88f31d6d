//! Layer normalization over the last dim (weight and bias `[H]`) and its input gradient.

use oxiflow_collectives::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::{sum_to, zeros_like, Grad};
use super::{
    need_float, same_dtype, shape_rule, single, Backend, F64Bits, Inferred, KernelBackend,
    MetaError, OpFamily, Saves,
};
use crate::dispatch::dispatch;
use crate::tensor::Tensor;
use crate::Result;

/// The normalization family. Inputs: (x, weight [H], bias [H]) and (x, weight [H], dy).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NormOp {
    LayerNorm {
        eps: F64Bits,
    },
    /// -> dx
    LayerNormBackward {
        eps: F64Bits,
    },
}

/// Normalization kernels of a backend (float pieces of one dtype).
pub trait NormKernels: KernelBackend {
    fn layer_norm(
        &self,
        x: &Self::Piece,
        weight: &Self::Piece,
        bias: &Self::Piece,
        eps: f64,
        out: &mut Self::Out,
    ) -> Result<()>;
    fn layer_norm_backward(
        &self,
        x: &Self::Piece,
        weight: &Self::Piece,
        dy: &Self::Piece,
        eps: f64,
        out: &mut Self::Out,
    ) -> Result<()>;
}

impl OpFamily for NormOp {
    fn name(&self) -> &'static str {
        match self {
            NormOp::LayerNorm { .. } => "layer_norm",
            NormOp::LayerNormBackward { .. } => "layer_norm_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (3, 3)
    }

    fn infer(
        &self,
        s: &[&Shape],
        d: &[DType],
        mode: RuleMode,
    ) -> std::result::Result<Inferred, MetaError> {
        let dt = same_dtype(d)?;
        need_float(dt, "input")?;
        let r = match self {
            NormOp::LayerNorm { .. } => rules::layer_norm(1, s, mode),
            NormOp::LayerNormBackward { .. } => rules::layer_norm_backward(1, s, mode),
        };
        Ok(Inferred::new(shape_rule(r)?, dt))
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        match self {
            NormOp::LayerNorm { eps } => b.layer_norm(x[0], x[1], x[2], eps.get(), y),
            NormOp::LayerNormBackward { eps } => {
                b.layer_norm_backward(x[0], x[1], x[2], eps.get(), y)
            }
        }
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            NormOp::LayerNorm { .. } => Saves::inputs(&[0, 1]),
            NormOp::LayerNormBackward { .. } => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let NormOp::LayerNorm { eps } = self else {
            return Err(Grad::unsupported(
                self.name(),
                "higher-order gradients are not supported",
            ));
        };
        let (xs, w, dy) = (g.input(0)?, g.input(1)?, g.dy()?);
        let (wm, bm) = (g.input_meta(1), g.input_meta(2));
        let eps = eps.get();
        Ok(vec![
            g.when(0, || Tensor::layer_norm_backward(xs, w, dy, eps))?,
            g.when(1, || {
                let ones = zeros_like(wm)?.add_scalar(1.0)?;
                let xhat = xs.layer_norm(&ones, &zeros_like(bm)?, eps)?;
                sum_to(xhat.mul(dy)?, wm)
            })?,
            g.when(2, || sum_to(dy.clone(), bm))?,
        ])
    }
}

impl Tensor {
    /// Layer norm over the last dim with weight and bias `[H]`.
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        let eps = F64Bits::new(eps);
        dispatch(NormOp::LayerNorm { eps }.into(), &[self, weight, bias])
    }
    /// dx of layer norm over the last dim.
    pub fn layer_norm_backward(
        x: &Tensor,
        weight: &Tensor,
        dy: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        let eps = F64Bits::new(eps);
        dispatch(NormOp::LayerNormBackward { eps }.into(), &[x, weight, dy])
    }
}
