//! A linear layer with its epilogue fused: (x `[.., K]`, w `[K, N]`[, bias `[N]`]) ->
//! `y = act(x w + bias)`, act none or GELU (the tanh form of [`Tensor::gelu`]); with GELU the
//! pre-activation `x w + bias` is a second output, saved for the backward (not
//! differentiable). The backward is `dpre = dy gelu'(pre)`, `dx = dpre w^T` and the weight
//! and bias gradients in one op (`x^T dpre` with the bias gradient's row sums fused). Its
//! products run at the op's [`MatmulPrecision`], as the backward's do.

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use crate::op::grad::sum_to;
use crate::op::{
    kernel_err, same_float_dtype, scratch, BinaryOp, CustomKernels, Grad, Inferred, KernelBackend,
    MetaError, MetaResult, OpFamily, OutSpec, RunKernels, Saves, UnaryOp,
};
use crate::tensor::Tensor;
use crate::Result;

/// The function applied to a linear layer's biased product.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `y = x w + bias`.
    #[default]
    None,
    /// `y = gelu(x w + bias)` (tanh form).
    Gelu,
}

/// The fused linear layer and its parameter gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinearOp {
    /// (x `[.., K]`, w `[K, N]`[, bias `[N]`]) -> y `[.., N]`, and with GELU the
    /// pre-activation `[.., N]`.
    Forward {
        act: Activation,
        precision: MatmulPrecision,
    },
    /// (x `[.., K]`, dpre `[.., N]`) -> dw `[K, N]` = x^T dpre over every leading dim, and with
    /// `bias` db `[N]` = the sum of dpre's rows.
    WeightGrad {
        bias: bool,
        precision: MatmulPrecision,
    },
}

/// Kernels of the fused linear layer (float pieces of one dtype).
pub trait LinearKernels: KernelBackend {
    /// `out` = [y] or, with GELU, [y, pre].
    fn linear(
        &self,
        act: Activation,
        precision: MatmulPrecision,
        x: &Self::Piece,
        w: &Self::Piece,
        bias: Option<&Self::Piece>,
        out: &mut [Self::Out],
    ) -> Result<()>;
    /// `out` = [dw] or, with a bias, [dw, db].
    fn linear_weight_grad(
        &self,
        precision: MatmulPrecision,
        x: &Self::Piece,
        dpre: &Self::Piece,
        out: &mut [Self::Out],
    ) -> Result<()>;
}


pub(super) fn shapes_text(s: &[&Shape]) -> String {
    s.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `x`'s shape with its last dim `n`.
pub(super) fn with_last(x: &Shape, n: usize) -> Shape {
    let mut d = x.dims().to_vec();
    if let Some(l) = d.last_mut() {
        *l = n;
    }
    Shape::new(d)
}

impl OpFamily for LinearOp {
    fn name(&self) -> &'static str {
        match self {
            LinearOp::Forward {
                act: Activation::None,
                ..
            } => "linear",
            LinearOp::Forward {
                act: Activation::Gelu,
                ..
            } => "linear_gelu",
            LinearOp::WeightGrad { .. } => "linear_weight_grad",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            LinearOp::Forward { .. } => (2, 3),
            LinearOp::WeightGrad { .. } => (2, 2),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = same_float_dtype(d, "input")?;
        let x = s[0];
        let Some(&k) = x.dims().last() else {
            return Err(MetaError::Shape("x must have at least one dim".into()));
        };
        let last = x.ndim() - 1;
        match *self {
            LinearOp::Forward { act, .. } => {
                let w = s[1];
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
                let outs = if act == Activation::Gelu { 2 } else { 1 };
                let r = rules::linear(x, s.len() == 3, with_last(x, n), outs, mode);
                Ok(Inferred::outputs(r, &vec![dt; outs]))
            }
            LinearOp::WeightGrad { bias, .. } => {
                let dp = s[1];
                if dp.ndim() != x.ndim() || dp.dims()[..last] != x.dims()[..last] {
                    return Err(MetaError::Shape(format!(
                        "needs x [.., K] and dpre [.., N] with the same leading dims, got {}",
                        shapes_text(s)
                    )));
                }
                let n = dp.dims()[last];
                let mut outs = vec![Shape::new([k, n])];
                if bias {
                    outs.push(Shape::new([n]));
                }
                let m = outs.len();
                let r = rules::linear_weight_grad(x, outs, mode);
                Ok(Inferred::outputs(r, &vec![dt; m]))
            }
        }
    }

    fn differentiable(&self, output: usize) -> bool {
        // The pre-activation is saved for the backward.
        !matches!(self, LinearOp::Forward { .. }) || output == 0
    }

    fn saves(&self, needs: &[bool]) -> Saves {
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        match *self {
            // w for dx; x for dw; the pre-activation for dpre.
            LinearOp::Forward { act, .. } => Saves::NOTHING
                .and_input_if(1, need(0))
                .and_input_if(0, need(1))
                .and_output_if(1, act == Activation::Gelu),
            LinearOp::WeightGrad { .. } => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let LinearOp::Forward { act, precision } = *self else {
            return Err(Grad::unsupported(
                self.name(),
                "higher-order gradients are not supported",
            ));
        };
        let dy = g.dy()?;
        let dpre = match act {
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
            let op = LinearOp::WeightGrad {
                bias: want_db,
                precision,
            };
            let mut out = Tensor::apply_all(op, &[g.input(0)?, &dpre])?.into_iter();
            (out.next(), out.next())
        } else {
            (None, None)
        };
        let db = match db {
            None if want_db => Some(sum_to(dpre, g.input_meta(2))?),
            db => db,
        };
        let mut v = vec![dx, dw];
        if bias {
            v.push(db);
        }
        Ok(v)
    }
}

impl<B: CustomKernels> RunKernels<B> for LinearOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let want = match *self {
            LinearOp::Forward { act, .. } => 1 + (act == Activation::Gelu) as usize,
            LinearOp::WeightGrad { bias, .. } => 1 + bias as usize,
        };
        if out.len() != want {
            return Err(kernel_err(
                self.name(),
                format!("expects {want} output buffers, got {}", out.len()),
            ));
        }
        match *self {
            LinearOp::Forward { act, precision } => {
                b.linear(act, precision, x[0], x[1], x.get(2).copied(), out)
            }
            LinearOp::WeightGrad { precision, .. } => {
                b.linear_weight_grad(precision, x[0], x[1], out)
            }
        }
    }
}

impl LinearOp {
    /// The forward composed of the matmul, add and GELU kernels (the CPU's kernel, and the
    /// device's where its fused product does not apply).
    pub fn composed_forward<B>(
        b: &B,
        (act, precision): (Activation, MatmulPrecision),
        x: &B::Piece,
        w: &B::Piece,
        bias: Option<&B::Piece>,
        out: &mut [B::Out],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
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
    pub fn composed_weight_grad<B>(
        b: &B,
        precision: MatmulPrecision,
        x: &B::Piece,
        dpre: &B::Piece,
        out: &mut [B::Out],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
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
