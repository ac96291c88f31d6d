//! Layer normalization over the last dim (weight and bias `[H]`): a three-output op, y with the
//! per-row mean and 1/std it saves for its backward (not differentiable), the input gradient
//! from those statistics, and the whole backward in one op (input, weight and bias gradients,
//! with a gradient the input has from its other consumers added to its own).

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    kernel_err, need_float, same_dtype, same_float_dtype, shape_rule, single, F64Bits, Inferred,
    KernelBackend, MetaError, MetaResult, OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// The dtype of the statistics of `dt` data: f32 for 16-bit floats (they are computed in f32),
/// else `dt` itself.
pub fn stats_dtype(dt: DType) -> DType {
    if dt.is_half() {
        DType::F32
    } else {
        dt
    }
}

/// The normalization family.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NormOp {
    /// (x, weight [H], bias [H]) -> (y, mean, rstd), mean and rstd `[.., 1]` (x's shape with
    /// the last dim 1; f32 for 16-bit data).
    LayerNorm { eps: F64Bits },
    /// (x, weight [H], dy, mean, rstd) -> dx.
    LayerNormBackward,
    /// (x, weight, mean, rstd, dy[, dr]) -> (dr + dx, dweight, dbias): the whole backward, with
    /// `dr`, the gradient x has from its other consumers (a residual stream's), added to dx.
    LayerNormGrads,
}

/// Normalization kernels of a backend (float pieces of one dtype).
pub trait NormKernels: KernelBackend {
    /// y, and each row's mean and 1 / sqrt(variance + eps).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &self,
        x: &Self::Piece,
        weight: &Self::Piece,
        bias: &Self::Piece,
        eps: f64,
        y: &mut Self::Out,
        mean: &mut Self::Out,
        rstd: &mut Self::Out,
    ) -> Result<()>;
    /// dx from dy and the forward's per-row mean and rstd.
    fn layer_norm_backward(
        &self,
        x: &Self::Piece,
        weight: &Self::Piece,
        dy: &Self::Piece,
        mean: &Self::Piece,
        rstd: &Self::Piece,
        dx: &mut Self::Out,
    ) -> Result<()>;
    /// `x` = [x, weight, mean, rstd, dy], `dr` x's gradient from its other consumers (None:
    /// zero); `out` = [dr + dx, dweight, dbias].
    fn layer_norm_grads(
        &self,
        x: [&Self::Piece; 5],
        dr: Option<&Self::Piece>,
        out: [&mut Self::Out; 3],
    ) -> Result<()>;
}

impl OpFamily for NormOp {
    fn name(&self) -> &'static str {
        match self {
            NormOp::LayerNorm { .. } => "layer_norm",
            NormOp::LayerNormBackward => "layer_norm_backward",
            NormOp::LayerNormGrads => "residual_layer_norm_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            NormOp::LayerNorm { .. } => (3, 3),
            NormOp::LayerNormBackward => (5, 5),
            NormOp::LayerNormGrads => (5, 6),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        match self {
            NormOp::LayerNorm { .. } => {
                let dt = same_float_dtype(d, "input")?;
                let stats = stats_dtype(dt);
                Ok(Inferred::outputs(
                    shape_rule(rules::layer_norm(1, s, mode))?,
                    &[dt, stats, stats],
                ))
            }
            NormOp::LayerNormBackward => {
                let dt = same_float_dtype(&d[..3], "input")?;
                let stats = stats_dtype(dt);
                if d[3..].iter().any(|&t| t != stats) {
                    return Err(MetaError::DType(format!(
                        "mean and rstd must be {stats} for {dt} data, got {} and {}",
                        d[3], d[4]
                    )));
                }
                Ok(Inferred::new(
                    shape_rule(rules::layer_norm_backward(1, s, mode))?,
                    dt,
                ))
            }
            NormOp::LayerNormGrads => grads_meta(s, d, mode),
        }
    }

    fn differentiable(&self, output: usize) -> bool {
        // The statistics are saved for the backward, not differentiated through.
        !matches!(self, NormOp::LayerNorm { .. }) || output == 0
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            NormOp::LayerNorm { .. } => Saves::inputs(&[0, 1]).and_outputs(&[1, 2]),
            NormOp::LayerNormBackward | NormOp::LayerNormGrads => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        if !matches!(self, NormOp::LayerNorm { .. }) {
            return Err(Grad::higher_order(self.name()));
        }
        let (x, w, dy) = (g.input(0)?, g.input(1)?, g.dy()?);
        let (mean, rstd) = (g.output(1)?, g.output(2)?);
        if !g.need(1) && !g.need(2) {
            return Ok(vec![
                g.when(0, || {
                    Tensor::apply(NormOp::LayerNormBackward, &[x, w, dy, mean, rstd])
                })?,
                None,
                None,
            ]);
        }
        // The parameters' gradients too: the residual norm's backward without a residual
        // gradient gives dx, dweight and dbias in one kernel (x-hat and the sums over rows in
        // the statistics' dtype, each rank's part rounded once to the weight's dtype: a partial
        // sum over split rows stays partial, reduced with the other gradients). x's gradient
        // from its other consumers (a residual stream's sum) comes in as the residual
        // gradient the kernel adds, saving the add.
        let partial = g.take_partial(0);
        let [dx, dw, db] = Tensor::layer_norm_grads(x, w, mean, rstd, dy, partial.as_ref())?;
        let keep = |i: usize, t: Tensor| g.need(i).then_some(t);
        Ok(vec![keep(0, dx), keep(1, dw), keep(2, db)])
    }
}

impl<B: NormKernels> RunKernels<B> for NormOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        match self {
            NormOp::LayerNorm { eps } => {
                let n = out.len();
                let [y, mean, rstd] = out else {
                    return Err(kernel_err(
                        self.name(),
                        format!("expects 3 output buffers, got {n}"),
                    ));
                };
                b.layer_norm(x[0], x[1], x[2], eps.get(), y, mean, rstd)
            }
            NormOp::LayerNormBackward => {
                let dx = single(self.name(), out)?;
                b.layer_norm_backward(x[0], x[1], x[2], x[3], x[4], dx)
            }
            NormOp::LayerNormGrads => {
                let n = out.len();
                let [dx, dw, db] = out else {
                    return Err(kernel_err(
                        self.name(),
                        format!("expects 3 output buffers, got {n}"),
                    ));
                };
                b.layer_norm_grads(
                    [x[0], x[1], x[2], x[3], x[4]],
                    x.get(5).copied(),
                    [dx, dw, db],
                )
            }
        }
    }
}

fn mismatch(what: &str, got: &Shape, want: &Shape) -> MetaError {
    MetaError::Shape(format!("{what} must be {want}, got {got}"))
}

/// The dtypes and rules of [`NormOp::LayerNormGrads`]: data, weight, dy and dr of one float
/// dtype, the statistics of its [`stats_dtype`], every shape the forward's.
fn grads_meta(s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
    let (x, w) = (s[0], s[1]);
    let dt = d[0];
    need_float(dt, "input")?;
    let st = stats_dtype(dt);
    let data = [d[0], d[1], d[4]]
        .into_iter()
        .chain(d.get(5).copied())
        .collect::<Vec<_>>();
    same_dtype(&data)?;
    if d[2] != st || d[3] != st {
        return Err(MetaError::DType(format!(
            "mean and rstd must be {st} for {dt} data, got {} and {}",
            d[2], d[3]
        )));
    }
    let ln = shape_rule(rules::layer_norm(1, &[x, w, w], RuleMode::ShapesOnly))?;
    let stats = &ln.out_shapes()[1];
    for (what, got, want) in [
        ("mean", s[2], stats),
        ("rstd", s[3], stats),
        ("dy", s[4], x),
    ]
    .into_iter()
    .chain(s.get(5).map(|t| ("dr", *t, x)))
    {
        if got != want {
            return Err(mismatch(what, got, want));
        }
    }
    let r = rules::residual_layer_norm_backward(x, w, s.len(), mode);
    Ok(Inferred::outputs(r, &[dt, dt, dt]))
}
