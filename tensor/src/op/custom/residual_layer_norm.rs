//! Residual add + LayerNorm over the last dim, fused: (x, a, weight [H], bias [H]) -> (r = x + a,
//! y = LayerNorm(r), mean, rstd), r and y differentiable, the per-row statistics saved for the
//! backward (not differentiable); the backward turns (dr, dy) into the residual stream's whole
//! gradient `dr + LN'(dy)` in one pass, with the weight and bias gradients.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use crate::op::{
    kernel_err, need_float, norm_stats_dtype, same_dtype, same_float_dtype, scratch, shape_rule,
    BinaryOp, CustomKernels, F64Bits, Grad, Inferred, KernelBackend, MetaError, MetaResult,
    OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// The fused residual LayerNorm and its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResidualLayerNorm {
    /// (x, a, weight [H], bias [H]) -> (r = x + a, y = LayerNorm(r), mean, rstd); mean and rstd
    /// `[.., 1]` (x's shape with the last dim 1; f32 for 16-bit data).
    Forward { eps: F64Bits },
    /// (r, weight, mean, rstd, dy[, dr]) -> (dr + LN'(dy), dweight, dbias): the gradient of
    /// the residual sum from the norm's output gradient `dy` and the sum's own `dr`.
    Backward,
}

/// The kernels of the fused residual LayerNorm (float pieces of one dtype, statistics of
/// [`norm_stats_dtype`]).
pub trait ResidualLayerNormKernels: KernelBackend {
    /// `out` = [r, y, mean, rstd].
    fn residual_layer_norm(
        &self,
        x: [&Self::Piece; 4],
        eps: f64,
        out: [&mut Self::Out; 4],
    ) -> Result<()>;
    /// `x` = [r, weight, mean, rstd, dy], `dr` the residual sum's own gradient (None: zero);
    /// `out` = [dr + LN'(dy), dweight, dbias].
    fn residual_layer_norm_backward(
        &self,
        x: [&Self::Piece; 5],
        dr: Option<&Self::Piece>,
        out: [&mut Self::Out; 3],
    ) -> Result<()>;
}


fn mismatch(what: &str, got: &Shape, want: &Shape) -> MetaError {
    MetaError::Shape(format!("{what} must be {want}, got {got}"))
}

impl OpFamily for ResidualLayerNorm {
    fn name(&self) -> &'static str {
        match self {
            ResidualLayerNorm::Forward { .. } => "residual_layer_norm",
            ResidualLayerNorm::Backward => "residual_layer_norm_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            ResidualLayerNorm::Forward { .. } => (4, 4),
            ResidualLayerNorm::Backward => (5, 6),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        match self {
            ResidualLayerNorm::Forward { .. } => {
                let dt = same_float_dtype(d, "input")?;
                if s[1] != s[0] {
                    return Err(mismatch("the residual branch", s[1], s[0]));
                }
                // The plain norm's rules check the shapes and give (y, mean, rstd).
                let ln = shape_rule(rules::layer_norm(1, &[s[0], s[2], s[3]], mode))?;
                let r = rules::residual_layer_norm(s[0], &ln.out_shapes()[1], mode);
                let st = norm_stats_dtype(dt);
                Ok(Inferred::outputs(r, &[dt, dt, st, st]))
            }
            ResidualLayerNorm::Backward => {
                let (x, w) = (s[0], s[1]);
                let dt = d[0];
                need_float(dt, "input")?;
                let st = norm_stats_dtype(dt);
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
        }
    }

    fn differentiable(&self, output: usize) -> bool {
        // r and y; the statistics are saved for the backward.
        !matches!(self, ResidualLayerNorm::Forward { .. }) || output < 2
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            // The sum r, the weight and the statistics.
            ResidualLayerNorm::Forward { .. } => Saves::inputs(&[2]).and_outputs(&[0, 2, 3]),
            ResidualLayerNorm::Backward => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        if !matches!(self, ResidualLayerNorm::Forward { .. }) {
            return Err(Grad::unsupported(
                self.name(),
                "higher-order gradients are not supported",
            ));
        }
        let dys = g.dys();
        let (dr, dy) = (
            dys.first().and_then(Option::as_ref),
            dys.get(1).and_then(Option::as_ref),
        );
        let (dx, dw, db) = match dy {
            Some(dy) => {
                let (r, w) = (g.output(0)?, g.input(2)?);
                let (mean, rstd) = (g.output(2)?, g.output(3)?);
                let [dx, dw, db] = Tensor::layer_norm_grads(r, w, mean, rstd, dy, dr)?;
                (Some(dx), Some(dw), Some(db))
            }
            // Only the sum has a gradient: it passes to both summands.
            None => (dr.cloned(), None, None),
        };
        let keep = |i: usize, t: Option<Tensor>| if g.need(i) { t } else { None };
        Ok(vec![
            keep(0, dx.clone()),
            keep(1, dx),
            keep(2, dw),
            keep(3, db),
        ])
    }
}

impl<B: CustomKernels> RunKernels<B> for ResidualLayerNorm {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let n = out.len();
        match (self, out) {
            (ResidualLayerNorm::Forward { eps }, [r, y, mean, rstd]) => {
                b.residual_layer_norm([x[0], x[1], x[2], x[3]], eps.get(), [r, y, mean, rstd])
            }
            (ResidualLayerNorm::Backward, [dx, dw, db]) => b.residual_layer_norm_backward(
                [x[0], x[1], x[2], x[3], x[4]],
                x.get(5).copied(),
                [dx, dw, db],
            ),
            _ => Err(kernel_err(self.name(), format!("got {n} output buffers"))),
        }
    }
}

impl ResidualLayerNorm {
    /// The forward composed of the add and LayerNorm kernels (the CPU's kernel, and the device's
    /// where its fused kernel does not apply).
    pub fn composed_forward<B>(
        b: &B,
        [x, a, w, bias]: [&B::Piece; 4],
        eps: f64,
        [r, y, mean, rstd]: [&mut B::Out; 4],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
        b.binary(BinaryOp::Add, x, a, r)?;
        b.layer_norm(r, w, bias, eps, y, mean, rstd)
    }

    /// The backward composed of kernels: LayerNorm's input gradient plus `dr`, and the weight and
    /// bias gradients as sums over the rows of `dy xhat` and `dy` (the statistics cast to the
    /// data's dtype where they differ).
    pub fn composed_backward<B>(
        b: &B,
        [r, w, mean, rstd, dy]: [&B::Piece; 5],
        dr: Option<&B::Piece>,
        [dx, dw, db]: [&mut B::Out; 3],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
        let data = b.out_spec(r);
        match dr {
            Some(dr) => {
                let t = scratch(b, &data, |t| b.layer_norm_backward(r, w, dy, mean, rstd, t))?;
                b.binary(BinaryOp::Add, &t, dr, dx)?;
            }
            None => b.layer_norm_backward(r, w, dy, mean, rstd, dx)?,
        }
        // The weight gradient's terms and their sum over rows in the statistics' dtype (f32
        // for 16-bit data, as the device kernel accumulates), rounded once to dw's dtype.
        let stats = b.out_spec(mean).dtype;
        let in_stats = |s: &B::Piece| -> Result<Option<B::Piece>> {
            let spec = b.out_spec(s);
            if spec.dtype == stats {
                return Ok(None);
            }
            let spec = crate::op::OutSpec {
                dtype: stats,
                ..spec
            };
            scratch(b, &spec, |t| b.cast(s, t)).map(Some)
        };
        let (r2, dy2) = (in_stats(r)?, in_stats(dy)?);
        let (rs, dys) = (r2.as_ref().unwrap_or(r), dy2.as_ref().unwrap_or(dy));
        let wide = crate::op::OutSpec {
            dtype: stats,
            ..data.clone()
        };
        let centred = scratch(b, &wide, |t| b.binary(BinaryOp::Sub, rs, mean, t))?;
        drop(r2);
        let xhat = scratch(b, &wide, |t| b.binary(BinaryOp::Mul, &centred, rstd, t))?;
        drop(centred);
        let prod = scratch(b, &wide, |t| b.binary(BinaryOp::Mul, &xhat, dys, t))?;
        drop((xhat, dy2));
        let dw_spec = b.out_spec(dw);
        if dw_spec.dtype == stats {
            b.sum_to_shape(&prod, dw)?;
        } else {
            let sum = scratch(
                b,
                &crate::op::OutSpec {
                    dtype: stats,
                    ..dw_spec
                },
                |t| b.sum_to_shape(&prod, t),
            )?;
            b.cast(&sum, dw)?;
        }
        b.sum_to_shape(dy, db)
    }
}
