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
//!
//! Two ops through the public op contract, [`ResidualMlp`] and [`ResidualMlpGrad`], on the
//! backends that implement `ResidualMlpKernels` (CPU composed, 16-bit through f32; CUDA
//! cuBLASLt epilogues, f64 composed); any other backend or dtype is `TensorError::NoKernel` on
//! every rank before anything runs.

mod cpu;
mod cuda;

use std::sync::LazyLock;

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use oxiflow_tensor::backend::{kernel_err, scratch};
use oxiflow_tensor::{
    dispatch_multi, BinaryOp, Extern, ExternOp, Grad, Inferred, KernelIo, Kernels, MetaError,
    MetaResult, Result, Saves, Tensor, UnaryOp,
};

use crate::dispatch_outputs::dispatch_first;
use crate::kernel_io::io_arrays;
use crate::linear::{Activation, LinearKernels};
use crate::op_signature::{
    kernels_first_output_differentiable, kernels_without_gradient, op_signature,
};
use crate::operand_dtypes::{generic_kernels, FLOATS};
use crate::operand_shapes::{float_last_dim, shapes_text, with_last};

/// The fused MLP with its residual add: (x, w_fc, b_fc, w_proj, b_proj, residual) -> (y, h,
/// pre); h is kept for the backward unless `recompute_hidden` (then computed again from pre).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResidualMlp {
    pub recompute_hidden: bool,
    pub precision: MatmulPrecision,
}

/// Its backward: (x, h, pre, w_fc, w_proj, dy) -> (dx, dw_fc, db_fc, dw_proj, db_proj).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResidualMlpGrad {
    pub precision: MatmulPrecision,
}

/// Kernels of the fused MLP (float pieces of one dtype), on the CPU and CUDA backends; each
/// is the composed kernel unless the backend has a fused one.
pub(crate) trait ResidualMlpKernels: LinearKernels {
    /// `x` = [x, w_fc, b_fc, w_proj, b_proj, residual]; `out` = [y, h, pre].
    fn residual_mlp(
        &self,
        x: [&Self::Piece; 6],
        precision: MatmulPrecision,
        out: &mut [Self::Out],
    ) -> Result<()> {
        Composed::forward(self, x, precision, out)
    }
    /// `x` = [x, h, pre, w_fc, w_proj, dy]; `out` = [dx, dw_fc, db_fc, dw_proj, db_proj].
    fn residual_mlp_backward(
        &self,
        x: [&Self::Piece; 6],
        precision: MatmulPrecision,
        out: &mut [Self::Out],
    ) -> Result<()> {
        Composed::backward(self, x, precision, out)
    }
}

fn bad(s: &[&Shape], want: &str) -> MetaError {
    MetaError::Shape(format!("needs {want}, got {}", shapes_text(s)))
}

static FORWARD: LazyLock<Kernels> = LazyLock::new(|| generic_kernels!(FLOATS, run_forward));

static BACKWARD: LazyLock<Kernels> = LazyLock::new(|| generic_kernels!(FLOATS, run_backward));

/// The forward on backend `b`.
fn run_forward<B: ResidualMlpKernels>(op: &ResidualMlp, b: &B, io: KernelIo<'_, B>) -> Result<()> {
    let (ins, out) = io_arrays::<_, _, 6, 3>(op.name(), io.inputs, io.outputs)?;
    b.residual_mlp(ins, op.precision, out)
}

/// The backward on backend `b`.
fn run_backward<B: ResidualMlpKernels>(
    op: &ResidualMlpGrad,
    b: &B,
    io: KernelIo<'_, B>,
) -> Result<()> {
    let (ins, out) = io_arrays::<_, _, 6, 5>(op.name(), io.inputs, io.outputs)?;
    b.residual_mlp_backward(ins, op.precision, out)
}

impl ExternOp for ResidualMlp {
    op_signature!("residual_mlp", 6);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&[u8::from(self.recompute_hidden), self.precision as u8]);
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let (dt, c) = float_last_dim(s, d)?;
        let x = s[0];
        let want = "x [.., C], w_fc [C, F], b_fc [F], w_proj [F, C], b_proj [C], residual like x";
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
    // h and pre are saved for the backward.
    kernels_first_output_differentiable!(FORWARD);
    fn saves(&self, needs: &[bool]) -> Saves {
        if !needs.iter().take(5).any(|&n| n) {
            return Saves::NOTHING;
        }
        Saves::NOTHING
            .and_input_if(0, true)
            .and_input_if(1, true)
            .and_input_if(3, true)
            .and_output_if(1, !self.recompute_hidden)
            .and_output_if(2, true)
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let dy = g.dy()?;
        let residual = g.need(5).then(|| dy.clone());
        if !(0..5).any(|i| g.need(i)) {
            return Ok(vec![None, None, None, None, None, residual]);
        }
        let pre = g.output(2)?;
        let recomputed = match self.recompute_hidden {
            true => Some(pre.unary(UnaryOp::Gelu)?),
            false => None,
        };
        let h = match &recomputed {
            Some(h) => h,
            None => g.output(1)?,
        };
        let ins = [g.input(0)?, h, pre, g.input(1)?, g.input(3)?, dy];
        let op = Extern::new(ResidualMlpGrad {
            precision: self.precision,
        });
        let out = dispatch_multi(op.into(), &ins)?;
        let mut v: Vec<Option<Tensor>> = out
            .into_iter()
            .enumerate()
            .map(|(i, t)| g.need(i).then_some(t))
            .collect();
        v.push(residual);
        Ok(v)
    }
}

impl ExternOp for ResidualMlpGrad {
    op_signature!("residual_mlp_backward", 6);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.push(self.precision as u8);
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let (dt, c) = float_last_dim(s, d)?;
        let x = s[0];
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
    kernels_without_gradient!(BACKWARD);
}

/// The fused MLP's kernels composed of the linear layer's kernels and core kernels.
pub(crate) struct Composed;

impl Composed {
    /// The forward composed of the linear layer's kernels and an add (the CPU's kernel, and
    /// the device's where its libraries refuse); `out` = [y, h, pre].
    pub(crate) fn forward<B: LinearKernels>(
        b: &B,
        [x, w_fc, b_fc, w_proj, b_proj, residual]: [&B::Piece; 6],
        precision: MatmulPrecision,
        out: &mut [B::Out],
    ) -> Result<()> {
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
    pub(crate) fn backward<B: LinearKernels>(
        b: &B,
        [x, h, pre, w_fc, w_proj, dy]: [&B::Piece; 6],
        precision: MatmulPrecision,
        out: &mut [B::Out],
    ) -> Result<()> {
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

/// `residual + gelu(x w_fc + b_fc) w_proj + b_proj` for x `[.., C]`, w_fc `[C, F]`, b_fc `[F]`,
/// w_proj `[F, C]`, b_proj `[C]` and residual like x, as one op (see [`ResidualMlp`]). Weights
/// split over ranks are gathered by the op's layouts: a tensor-parallel MLP composes its
/// linear layers instead.
pub fn residual_mlp(
    x: &Tensor,
    w_fc: &Tensor,
    b_fc: &Tensor,
    w_proj: &Tensor,
    b_proj: &Tensor,
    residual: &Tensor,
) -> Result<Tensor> {
    let f32 = MatmulPrecision::F32;
    residual_mlp_with(x, w_fc, b_fc, w_proj, b_proj, residual, (false, f32))
}

/// [`residual_mlp`] keeping only the pre-activation for the backward when `recompute_hidden`
/// (which computes GELU's output again from it): one `[.., F]` tensor less kept, one
/// element-wise pass more; its f32 products at `precision` on a device.
pub fn residual_mlp_with(
    x: &Tensor,
    w_fc: &Tensor,
    b_fc: &Tensor,
    w_proj: &Tensor,
    b_proj: &Tensor,
    residual: &Tensor,
    (recompute_hidden, precision): (bool, MatmulPrecision),
) -> Result<Tensor> {
    let ins = [x, w_fc, b_fc, w_proj, b_proj, residual];
    let op = ResidualMlp {
        recompute_hidden,
        precision,
    };
    dispatch_first(op, &ins)
}
