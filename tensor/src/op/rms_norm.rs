//! RMS normalization over the last dim: `y = x / sqrt(mean(x^2) + eps) * weight`, weight `[H]`.
//! The backward is written with ops, so its gradients get their SBP by inference.

use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Shape};

use super::grad::{sum_to, Grad};
use super::{
    kernel_trait, name_and_arity, same_float_dtype, single, F64Bits, Inferred, MetaError,
    MetaResult, OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// The RMS-norm family. Inputs: (x [.., H], weight [H]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RmsNormOp {
    Forward { eps: F64Bits },
}

kernel_trait! {
    /// RMS-norm kernels of a backend (float pieces of one dtype).
    pub trait RmsNormKernels {
        fn rms_norm(x: &Self::Piece, weight: &Self::Piece, eps: f64);
    }
}

impl OpFamily for RmsNormOp {
    name_and_arity!("rms_norm", 2);

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = same_float_dtype(d, "input")?;
        let r = oxiflow_sbp::rules::rms_norm(s[0], s[1], mode).map_err(MetaError::Shape)?;
        Ok(Inferred::new(r, dt))
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        Saves::inputs(&[0, 1])
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let RmsNormOp::Forward { eps } = self;
        let (x, w, dy) = (g.input(0)?, g.input(1)?, g.dy()?);
        // r = (mean(x^2) + eps)^-1/2, xhat = x r, y = xhat w:
        // dx = r (dy w - xhat mean(dy w xhat)), dw = sum over rows of dy xhat.
        let r = x
            .square()?
            .mean(&[-1], true)?
            .add_scalar(eps.get())?
            .pow_scalar(-0.5)?;
        let xhat = x.mul(&r)?;
        Ok(vec![
            g.when(0, || {
                let gw = dy.mul(w)?;
                let proj = gw.mul(&xhat)?.mean(&[-1], true)?;
                r.mul(&gw.sub(&xhat.mul(&proj)?)?)
            })?,
            g.when(1, || sum_to(dy.mul(&xhat)?, g.input_meta(1)))?,
        ])
    }
}

impl<B: RmsNormKernels> RunKernels<B> for RmsNormOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        let RmsNormOp::Forward { eps } = self;
        b.rms_norm(x[0], x[1], eps.get(), y)
    }
}
