//! A transformer's MLP with its residual add, as one op: (x `[.., C]`, w_fc `[C, F]`, b_fc
//! `[F]`, w_proj `[F, C]`, b_proj `[C]`, residual `[.., C]`) -> `y = residual + gelu(x w_fc +
//! b_fc) w_proj + b_proj`, with the hidden activation `h = gelu(pre)` and `pre = x w_fc + b_fc`
//! as outputs saved for the backward (not differentiable). Being one op lets each product
//! take what follows it into its epilogue: on CUDA the forward is two cuBLASLt products (bias
//! and GELU in the first's epilogue; bias and the residual, read as the product's C operand, in
//! the second's), and the backward computes `dpre = (dy w_proj^T) gelu'(pre)` in one product's
//! epilogue, so neither the residual add nor the GELU backward is a pass of its own. The
//! residual's gradient is `dy` itself. With `recompute_hidden` the forward keeps `pre` alone
//! and the backward computes `h = gelu(pre)` again (one element-wise pass), as torch's
//! min-cut partitioner does for cheap activations: a `[.., F]` tensor less per block.
//!
//! Rows split or whole, every weight whole: a tensor-parallel MLP (split weights) composes the
//! linear layers instead (the model chooses). Its products run at the op's
//! [`MatmulPrecision`], forward and backward.

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use crate::op::custom::linear::{shapes_text, with_last};
use crate::op::custom::Activation;
use crate::op::{
    kernel_err, same_float_dtype, scratch, BinaryOp, CustomKernels, Grad, Inferred, KernelBackend,
    MetaError, MetaResult, OpFamily, RunKernels, Saves, UnaryOp,
};
use crate::tensor::Tensor;
use crate::Result;

/// The fused MLP with its residual add, and its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResidualMlp {
    /// (x, w_fc, b_fc, w_proj, b_proj, residual) -> (y, h, pre); h is kept for the backward
    /// unless `recompute_hidden` (then computed again from pre).
    Forward {
        recompute_hidden: bool,
        precision: MatmulPrecision,
    },
    /// (x, h, pre, w_fc, w_proj, dy) -> (dx, dw_fc, db_fc, dw_proj, db_proj).
    Backward { precision: MatmulPrecision },
}

/// Kernels of the fused MLP (float pieces of one dtype).
pub trait ResidualMlpKernels: KernelBackend {
    /// `x` = [x, w_fc, b_fc, w_proj, b_proj, residual]; `out` = [y, h, pre].
    fn residual_mlp(
        &self,
        x: [&Self::Piece; 6],
        precision: MatmulPrecision,
        out: &mut [Self::Out],
    ) -> Result<()>;
    /// `x` = [x, h, pre, w_fc, w_proj, dy]; `out` = [dx, dw_fc, db_fc, dw_proj, db_proj].
    fn residual_mlp_backward(
        &self,
        x: [&Self::Piece; 6],
        precision: MatmulPrecision,
        out: &mut [Self::Out],
    ) -> Result<()>;
}


fn bad(s: &[&Shape], want: &str) -> MetaError {
    MetaError::Shape(format!("needs {want}, got {}", shapes_text(s)))
}

impl OpFamily for ResidualMlp {
    fn name(&self) -> &'static str {
        match self {
            ResidualMlp::Forward { .. } => "residual_mlp",
            ResidualMlp::Backward { .. } => "residual_mlp_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (6, 6)
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = same_float_dtype(d, "operand")?;
        let x = s[0];
        let Some(&c) = x.dims().last() else {
            return Err(MetaError::Shape("x must have at least one dim".into()));
        };
        match self {
            ResidualMlp::Forward { .. } => {
                let want =
                    "x [.., C], w_fc [C, F], b_fc [F], w_proj [F, C], b_proj [C], residual like x";
                let f = match s[1].dims() {
                    [wc, f] if *wc == c => *f,
                    _ => return Err(bad(s, want)),
                };
                if s[2].dims() != [f] || s[3].dims() != [f, c] || s[4].dims() != [c] || s[5] != x {
                    return Err(bad(s, want));
                }
                let r = rules::residual_mlp(x, &with_last(x, f), mode);
                Ok(Inferred::outputs(r, &[dt; 3]))
            }
            ResidualMlp::Backward { .. } => {
                let want = "x [.., C], h and pre [.., F], w_fc [C, F], w_proj [F, C], dy like x";
                let f = match s[3].dims() {
                    [wc, f] if *wc == c => *f,
                    _ => return Err(bad(s, want)),
                };
                let hid = with_last(x, f);
                if *s[1] != hid || *s[2] != hid || s[4].dims() != [f, c] || s[5] != x {
                    return Err(bad(s, want));
                }
                let outs = [
                    x.clone(),
                    Shape::new([c, f]),
                    Shape::new([f]),
                    Shape::new([f, c]),
                    Shape::new([c]),
                ];
                let r = rules::residual_mlp_backward(x, outs, mode);
                Ok(Inferred::outputs(r, &[dt; 5]))
            }
        }
    }

    fn differentiable(&self, output: usize) -> bool {
        // h and pre are saved for the backward.
        matches!(self, ResidualMlp::Backward { .. }) || output == 0
    }

    fn saves(&self, needs: &[bool]) -> Saves {
        match self {
            ResidualMlp::Forward {
                recompute_hidden, ..
            } if needs.iter().take(5).any(|&n| n) => {
                Saves::NOTHING
                    .and_input_if(0, true)
                    .and_input_if(1, true)
                    .and_input_if(3, true)
                    .and_output_if(1, !recompute_hidden)
                    .and_output_if(2, true)
            }
            _ => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let ResidualMlp::Forward { precision, .. } = *self else {
            return Err(Grad::unsupported(
                self.name(),
                "higher-order gradients are not supported",
            ));
        };
        let dy = g.dy()?;
        let residual = g.need(5).then(|| dy.clone());
        if !(0..5).any(|i| g.need(i)) {
            return Ok(vec![None, None, None, None, None, residual]);
        }
        let pre = g.output(2)?;
        let recomputed = match self {
            ResidualMlp::Forward {
                recompute_hidden: true,
                ..
            } => Some(pre.unary(UnaryOp::Gelu)?),
            _ => None,
        };
        let h = match &recomputed {
            Some(h) => h,
            None => g.output(1)?,
        };
        let ins = [g.input(0)?, h, pre, g.input(1)?, g.input(3)?, dy];
        let out = Tensor::apply_all(ResidualMlp::Backward { precision }, &ins)?;
        let mut v: Vec<Option<Tensor>> = out
            .into_iter()
            .enumerate()
            .map(|(i, t)| g.need(i).then_some(t))
            .collect();
        v.push(residual);
        Ok(v)
    }
}

impl<B: CustomKernels> RunKernels<B> for ResidualMlp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let ins = [x[0], x[1], x[2], x[3], x[4], x[5]];
        match (self, out.len()) {
            (ResidualMlp::Forward { precision, .. }, 3) => b.residual_mlp(ins, *precision, out),
            (ResidualMlp::Backward { precision }, 5) => {
                b.residual_mlp_backward(ins, *precision, out)
            }
            (_, n) => Err(kernel_err(self.name(), format!("got {n} output buffers"))),
        }
    }
}

impl ResidualMlp {
    /// The forward composed of the linear layer's kernels and an add (the CPU's kernel, and
    /// the device's where its libraries refuse); `out` = [y, h, pre].
    pub fn composed_forward<B>(
        b: &B,
        [x, w_fc, b_fc, w_proj, b_proj, residual]: [&B::Piece; 6],
        precision: MatmulPrecision,
        out: &mut [B::Out],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
        let (y, hp) = match out {
            [y, rest @ ..] if rest.len() == 2 => (y, rest),
            _ => {
                return Err(kernel_err(
                    "residual_mlp",
                    "expects 3 output buffers".into(),
                ))
            }
        };
        b.linear(Activation::Gelu, precision, x, w_fc, Some(b_fc), hp)?;
        let spec = b.out_spec(y);
        let m = scratch(b, &spec, |t| {
            b.linear(
                Activation::None,
                precision,
                &hp[0],
                w_proj,
                Some(b_proj),
                std::slice::from_mut(t),
            )
        })?;
        b.binary(BinaryOp::Add, residual, &m, y)
    }

    /// The backward composed of products, the GELU backward and the linear layer's weight
    /// gradients (the CPU's kernel, and the device's where its libraries refuse); `out` =
    /// [dx, dw_fc, db_fc, dw_proj, db_proj].
    pub fn composed_backward<B>(
        b: &B,
        [x, h, pre, w_fc, w_proj, dy]: [&B::Piece; 6],
        precision: MatmulPrecision,
        out: &mut [B::Out],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
        if out.len() != 5 {
            return Err(kernel_err(
                "residual_mlp_backward",
                format!("expects 5 output buffers, got {}", out.len()),
            ));
        }
        let (dx, rest) = out.split_at_mut(1);
        let (fc, proj) = rest.split_at_mut(2);
        let hid = b.out_spec(pre);
        let dh = scratch(b, &hid, |t| {
            b.matmul_t(dy, w_proj, (false, true), false, precision, t)
        })?;
        let dpre = scratch(b, &hid, |t| b.unary_backward(UnaryOp::Gelu, &dh, pre, t))?;
        drop(dh);
        b.matmul_t(&dpre, w_fc, (false, true), false, precision, &mut dx[0])?;
        b.linear_weight_grad(precision, x, &dpre, fc)?;
        b.linear_weight_grad(precision, h, dy, proj)
    }
}
