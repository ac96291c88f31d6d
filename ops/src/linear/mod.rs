//! A linear layer with its epilogue fused: (x `[.., K]`, w `[K, N]`[, bias `[N]`]) ->
//! `y = act(x w + bias)`, act none or GELU (the tanh form of [`Tensor::gelu`]); with GELU the
//! pre-activation `x w + bias` is a second output, saved for the backward (not
//! differentiable). The backward is `dpre = dy gelu'(pre)`, `dx = dpre w^T` and the weight
//! and bias gradients in one op (`x^T dpre` with the bias gradient's row sums fused). Its
//! products run at the op's [`MatmulPrecision`], as the backward's do.
//!
//! Two ops through the public op contract, [`Linear`] and [`LinearWeightGrad`], on the
//! backends that implement `LinearKernels`: the CPU composes the matmul, add and GELU
//! kernels (16-bit through f32); CUDA runs one cuBLASLt product with the epilogue (f64, bf16
//! matmul precision and what cuBLASLt refuses composed). Any other backend or dtype is
//! `TensorError::NoKernel` on every rank before anything runs.

mod cpu;
mod cuda;

use std::sync::LazyLock;

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use oxiflow_tensor::backend::{kernel_err, scratch};
use oxiflow_tensor::{
    dispatch_multi, BinaryOp, Extern, ExternOp, Grad, Inferred, KernelIo, Kernels, MetaError,
    MetaResult, OutSpec, Result, Saves, Tensor, UnaryOp,
};

use crate::composing_backend::ComposingBackend;
use crate::dispatch_outputs::dispatch_first;
use crate::op_signature::{
    kernels_first_output_differentiable, kernels_without_gradient, op_signature,
};
use crate::operand_dtypes::{generic_kernels, FLOATS};
use crate::operand_shapes::{float_last_dim, shapes_text, with_last};

/// The function applied to a linear layer's biased product.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `y = x w + bias`.
    #[default]
    None,
    /// `y = gelu(x w + bias)` (tanh form).
    Gelu,
}

/// The fused linear layer: (x `[.., K]`, w `[K, N]`[, bias `[N]`]) -> y `[.., N]`, and with
/// GELU the pre-activation `[.., N]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    pub act: Activation,
    pub precision: MatmulPrecision,
}

/// Its parameter gradients: (x `[.., K]`, dpre `[.., N]`) -> dw `[K, N]` = x^T dpre over every
/// leading dim, and with `bias` db `[N]` = the sum of dpre's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearWeightGrad {
    pub bias: bool,
    pub precision: MatmulPrecision,
}

/// Kernels of the fused linear layer (float pieces of one dtype), on the CPU and CUDA
/// backends; the fused MLP composes them. Each is the composed kernel unless the backend
/// has a fused one.
pub(crate) trait LinearKernels: ComposingBackend + Sized {
    /// `out` = [y] or, with GELU, [y, pre].
    fn linear(
        &self,
        act: Activation,
        precision: MatmulPrecision,
        x: &Self::Piece,
        w: &Self::Piece,
        bias: Option<&Self::Piece>,
        out: &mut [Self::Out],
    ) -> Result<()> {
        Composed::forward(self, (act, precision), x, w, bias, out)
    }
    /// `out` = [dw] or, with a bias, [dw, db].
    fn linear_weight_grad(
        &self,
        precision: MatmulPrecision,
        x: &Self::Piece,
        dpre: &Self::Piece,
        out: &mut [Self::Out],
    ) -> Result<()> {
        Composed::weight_grad(self, precision, x, dpre, out)
    }
}

static FORWARD: LazyLock<Kernels> = LazyLock::new(|| generic_kernels!(FLOATS, run_forward));

static WEIGHT_GRAD: LazyLock<Kernels> = LazyLock::new(|| generic_kernels!(FLOATS, run_weight_grad));

/// The forward on backend `b`: every output buffer of the call, checked against the op.
fn run_forward<B: LinearKernels>(op: &Linear, b: &B, io: KernelIo<'_, B>) -> Result<()> {
    let want = 1 + usize::from(op.act == Activation::Gelu);
    let (x, out) = (io.inputs, io.outputs);
    if out.len() != want || x.len() < 2 {
        return Err(kernel_err(
            op.name(),
            format!("expects {want} output buffers, got {}", out.len()),
        ));
    }
    b.linear(op.act, op.precision, x[0], x[1], x.get(2).copied(), out)
}

/// The weight gradients on backend `b`.
fn run_weight_grad<B: LinearKernels>(
    op: &LinearWeightGrad,
    b: &B,
    io: KernelIo<'_, B>,
) -> Result<()> {
    let want = 1 + usize::from(op.bias);
    let (x, out) = (io.inputs, io.outputs);
    if out.len() != want || x.len() != 2 {
        return Err(kernel_err(
            op.name(),
            format!("expects {want} output buffers, got {}", out.len()),
        ));
    }
    b.linear_weight_grad(op.precision, x[0], x[1], out)
}

impl ExternOp for Linear {
    fn name(&self) -> &'static str {
        match self.act {
            Activation::None => "linear",
            Activation::Gelu => "linear_gelu",
        }
    }
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&[self.act as u8, self.precision as u8]);
    }
    fn arity(&self) -> (usize, usize) {
        (2, 3)
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let (dt, k) = float_last_dim(s, d)?;
        let (x, w) = (s[0], s[1]);
        let (wk, n) = match w.dims() {
            [wk, n] => (*wk, *n),
            _ => (0, usize::MAX),
        };
        let bias_ok = s.get(2).is_none_or(|b| b.dims() == [n]);
        if wk != k || !bias_ok {
            return Err(MetaError::Shape(format!(
                "needs x [.., K], weight [K, N] and bias [N], got {}",
                shapes_text(s)
            )));
        }
        let outs = if self.act == Activation::Gelu { 2 } else { 1 };
        let r = rules::linear(x, s.len() == 3, with_last(x, n), outs, mode);
        Ok(Inferred::outputs(r, &vec![dt; outs]))
    }
    // The pre-activation is saved for the backward.
    kernels_first_output_differentiable!(FORWARD);
    fn saves(&self, needs: &[bool]) -> Saves {
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        // w for dx; x for dw; the pre-activation for dpre.
        Saves::NOTHING
            .and_input_if(1, need(0))
            .and_input_if(0, need(1))
            .and_output_if(1, self.act == Activation::Gelu)
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let precision = self.precision;
        let dy = g.dy()?;
        let dpre = match self.act {
            Activation::None => dy.clone(),
            Activation::Gelu => dy.unary_backward(UnaryOp::Gelu, g.output(1)?)?,
        };
        // dx = dpre w^T, plus x's gradient from its other consumers in the same product (the
        // Q, K and V projections of one input).
        let dx = g.when(0, || match g.take_partial(0) {
            Some(acc) => dpre.matmul_t_acc_at(g.input(1)?, (false, true), &acc, precision),
            None => dpre.matmul_t_at(g.input(1)?, (false, true), precision),
        })?;
        let bias = g.arity() == 3;
        let want_db = bias && g.need(2);
        let (dw, db) = if g.need(1) {
            let op = Extern::new(LinearWeightGrad {
                bias: want_db,
                precision,
            });
            let mut out = dispatch_multi(op.into(), &[g.input(0)?, &dpre])?.into_iter();
            (out.next(), out.next())
        } else {
            (None, None)
        };
        let db = match db {
            None if want_db => Some(dpre.sum_to_shape(g.input_meta(2).shape().clone())?),
            db => db,
        };
        let mut v = vec![dx, dw];
        if bias {
            v.push(db);
        }
        Ok(v)
    }
}

impl ExternOp for LinearWeightGrad {
    op_signature!("linear_weight_grad", 2);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&[u8::from(self.bias), self.precision as u8]);
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let (dt, k) = float_last_dim(s, d)?;
        let (x, dp) = (s[0], s[1]);
        let last = x.ndim() - 1;
        if dp.ndim() != x.ndim() || dp.dims()[..last] != x.dims()[..last] {
            return Err(MetaError::Shape(format!(
                "needs x [.., K] and dpre [.., N] with the same leading dims, got {}",
                shapes_text(s)
            )));
        }
        let n = dp.dims()[last];
        let mut outs = vec![Shape::new([k, n])];
        if self.bias {
            outs.push(Shape::new([n]));
        }
        let m = outs.len();
        let r = rules::linear_weight_grad(x, outs, mode);
        Ok(Inferred::outputs(r, &vec![dt; m]))
    }
    kernels_without_gradient!(WEIGHT_GRAD);
}

/// The fused linear layer's kernels composed of core kernels, on any backend.
pub(crate) struct Composed;

impl Composed {
    /// The forward composed of the matmul, add and GELU kernels (the CPU's kernel, and the
    /// device's where its fused product does not apply).
    pub(crate) fn forward<B: ComposingBackend>(
        b: &B,
        (act, precision): (Activation, MatmulPrecision),
        x: &B::Piece,
        w: &B::Piece,
        bias: Option<&B::Piece>,
        out: &mut [B::Out],
    ) -> Result<()> {
        let n = out.len();
        let (y, pre) = match out {
            [y] => (y, None),
            [y, pre] => (y, Some(pre)),
            _ => return Err(kernel_err("linear", format!("got {n} output buffers"))),
        };
        let spec = b.out_spec(y);
        // The biased product goes to the pre-activation, or straight to y.
        let target = match (act, pre) {
            (Activation::Gelu, Some(p)) => p,
            (Activation::None, None) => &mut *y,
            _ => return Err(kernel_err("linear", format!("got {n} output buffers"))),
        };
        match bias {
            Some(bias) => {
                let t = scratch(b, &spec, |t| b.matmul(x, w, precision, t))?;
                b.binary(BinaryOp::Add, &t, bias, target)?;
            }
            None => b.matmul(x, w, precision, target)?,
        }
        if let [y, pre] = out {
            b.unary(UnaryOp::Gelu, pre, y)?;
        }
        Ok(())
    }

    /// The parameter gradients composed of kernels: `x^T dpre` over x's rows (x viewed as
    /// `[rows, K]`) and dpre's row sums.
    pub(crate) fn weight_grad<B: ComposingBackend>(
        b: &B,
        precision: MatmulPrecision,
        x: &B::Piece,
        dpre: &B::Piece,
        out: &mut [B::Out],
    ) -> Result<()> {
        let (xs, ds) = (b.out_spec(x), b.out_spec(dpre));
        let rows = |s: &OutSpec| {
            let (k, lead) = s
                .shape
                .dims()
                .split_last()
                .map_or((0, &[][..]), |(k, l)| (*k, l));
            OutSpec {
                shape: Shape::new([lead.iter().product::<usize>(), k]),
                dtype: s.dtype,
            }
        };
        let (x2, d2) = (b.reshaped(x, &rows(&xs))?, b.reshaped(dpre, &rows(&ds))?);
        match out {
            [dw] => b.matmul_t(&x2, &d2, (true, false), false, precision, dw),
            [dw, db] => {
                b.matmul_t(&x2, &d2, (true, false), false, precision, dw)?;
                b.sum_to_shape(dpre, db)
            }
            _ => Err(kernel_err(
                "linear_weight_grad",
                format!("got {} output buffers", out.len()),
            )),
        }
    }
}

/// `act(x w + bias)` for x `[.., K]`, w `[K, N]`, bias `[N]`, in one op (on CUDA one cuBLASLt
/// product with the bias and GELU in its epilogue).
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, act: Activation) -> Result<Tensor> {
    linear_at(x, w, bias, act, MatmulPrecision::F32)
}

/// [`linear`] with f32 products at `precision` on a device (forward and backward).
pub fn linear_at(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    act: Activation,
    precision: MatmulPrecision,
) -> Result<Tensor> {
    let mut ins = vec![x, w];
    ins.extend(bias);
    dispatch_first(Linear { act, precision }, &ins)
}
