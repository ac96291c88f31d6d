//! Element-wise ops: unary functions, tensor-scalar functions, broadcasting binary ops, casts,
//! and the unary functions' backward (`dx = dy * f'(x)`).

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, BinaryOp as SbpBinary, RuleMode, Shape};

use super::grad::{sum_to, Grad};
use super::{
    kernel_trait, need_float, same_dtype, same_float_dtype, shape_rule, single, F64Bits, Inferred,
    MetaError, MetaResult, OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// Element-wise unary functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Relu,
    /// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    Gelu,
    Exp,
    Log,
    Tanh,
    Sigmoid,
    Sqrt,
    Abs,
    Square,
}

impl UnaryOp {
    /// Linear functions keep a partial-sum SBP.
    pub fn is_linear(self) -> bool {
        matches!(self, UnaryOp::Neg)
    }
    /// Whether the function is defined on i64 (the others need a float dtype).
    pub fn takes_integers(self) -> bool {
        matches!(
            self,
            UnaryOp::Neg | UnaryOp::Relu | UnaryOp::Abs | UnaryOp::Square
        )
    }
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Abs => "abs",
            UnaryOp::Square => "square",
        }
    }
    /// Whether the backward reads the output (`dy * f'(x)` written with y = f(x)) rather than
    /// the input: exp, tanh and sigmoid.
    pub fn saves_output(self) -> bool {
        matches!(self, UnaryOp::Exp | UnaryOp::Tanh | UnaryOp::Sigmoid)
    }
    pub fn backward_name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg_backward",
            UnaryOp::Relu => "relu_backward",
            UnaryOp::Gelu => "gelu_backward",
            UnaryOp::Exp => "exp_backward",
            UnaryOp::Log => "log_backward",
            UnaryOp::Tanh => "tanh_backward",
            UnaryOp::Sigmoid => "sigmoid_backward",
            UnaryOp::Sqrt => "sqrt_backward",
            UnaryOp::Abs => "abs_backward",
            UnaryOp::Square => "square_backward",
        }
    }
}

/// Broadcasting binary functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }
    fn sbp(self) -> SbpBinary {
        match self {
            BinaryOp::Add => SbpBinary::Add,
            BinaryOp::Sub => SbpBinary::Sub,
            BinaryOp::Mul => SbpBinary::Mul,
            BinaryOp::Div => SbpBinary::Div,
        }
    }
}

/// Functions of a tensor and a scalar `c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScalarOp {
    /// x + c
    Add,
    /// x * c (linear: keeps P)
    Mul,
    /// c - x
    RSub,
    /// c / x
    RDiv,
    /// x ^ c
    Pow,
}

impl ScalarOp {
    pub fn name(self) -> &'static str {
        match self {
            ScalarOp::Add => "add_scalar",
            ScalarOp::Mul => "mul_scalar",
            ScalarOp::RSub => "rsub_scalar",
            ScalarOp::RDiv => "rdiv_scalar",
            ScalarOp::Pow => "pow_scalar",
        }
    }
    /// Whether the function is defined on i64.
    pub fn takes_integers(self) -> bool {
        matches!(self, ScalarOp::Add | ScalarOp::Mul | ScalarOp::RSub)
    }
}

/// The element-wise family.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ElementwiseOp {
    Unary(UnaryOp),
    Scalar(ScalarOp, F64Bits),
    Binary(BinaryOp),
    Cast(DType),
    /// A cast of each rank's piece as it is: a partial sum stays partial, each part rounded
    /// once ([`Tensor::to_dtype_parts`]).
    CastParts(DType),
    /// (dy, saved) -> dx for y = f(x), where `saved` is what the forward saves: y for exp,
    /// tanh and sigmoid (`UnaryOp::saves_output`), x otherwise.
    UnaryBackward(UnaryOp),
}

kernel_trait! {
    /// Element-wise kernels of a backend. Inputs and output have the dtypes `infer` allowed;
    /// `binary` broadcasts both operands to `out.shape`.
    pub trait ElementwiseKernels {
        fn unary(u: UnaryOp, x: &Self::Piece);
        fn scalar(s: ScalarOp, c: f64, x: &Self::Piece);
        fn binary(b: BinaryOp, x: &Self::Piece, y: &Self::Piece);
        fn cast(x: &Self::Piece);
        fn unary_backward(u: UnaryOp, dy: &Self::Piece, x: &Self::Piece);
    }
}

/// Broadcast two shapes (numpy rules, aligned from the right).
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Option<Shape> {
    rules::broadcast_shape(a, b)
}

impl OpFamily for ElementwiseOp {
    fn name(&self) -> &'static str {
        match self {
            ElementwiseOp::Unary(u) => u.name(),
            ElementwiseOp::Scalar(s, _) => s.name(),
            ElementwiseOp::Binary(b) => b.name(),
            ElementwiseOp::Cast(_) => "cast",
            ElementwiseOp::CastParts(_) => "cast_parts",
            ElementwiseOp::UnaryBackward(u) => u.backward_name(),
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            ElementwiseOp::Binary(_) | ElementwiseOp::UnaryBackward(_) => (2, 2),
            _ => (1, 1),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        match self {
            ElementwiseOp::Unary(u) => {
                if !u.takes_integers() {
                    need_float(d[0], "input")?;
                }
                Ok(Inferred::new(rules::unary(s[0], u.is_linear(), mode), d[0]))
            }
            ElementwiseOp::Scalar(op, _) => {
                if !op.takes_integers() {
                    need_float(d[0], "input")?;
                }
                let linear = *op == ScalarOp::Mul;
                Ok(Inferred::new(rules::unary(s[0], linear, mode), d[0]))
            }
            // A cast that never rounds keeps partial sums (the sum of converted pieces is the
            // converted sum); one that may round needs whole values first.
            ElementwiseOp::Cast(to) => Ok(Inferred::new(
                rules::unary(s[0], to.holds_every(d[0]), mode),
                *to,
            )),
            ElementwiseOp::CastParts(to) => Ok(Inferred::new(rules::unary(s[0], true, mode), *to)),
            ElementwiseOp::Binary(b) => {
                let dt = same_dtype(d)?;
                if dt == DType::I64 && *b == BinaryOp::Div {
                    return Err(MetaError::DType(
                        "division needs a float dtype, got i64".into(),
                    ));
                }
                Ok(Inferred::new(
                    shape_rule(rules::binary(b.sbp(), s[0], s[1], mode))?,
                    dt,
                ))
            }
            ElementwiseOp::UnaryBackward(_) => {
                let dt = same_float_dtype(d, "input")?;
                if s[0] != s[1] {
                    return Err(MetaError::Shape(format!(
                        "dy and the saved tensor differ: {} vs {}",
                        s[0], s[1]
                    )));
                }
                // dx = dy * f'(x): linear in dy, not in x; Div's table ((P, B) -> P) is that.
                Ok(Inferred::new(
                    shape_rule(rules::binary(SbpBinary::Div, s[0], s[1], mode))?,
                    dt,
                ))
            }
        }
    }

    fn saves(&self, needs: &[bool]) -> Saves {
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        match self {
            ElementwiseOp::Unary(UnaryOp::Neg) => Saves::NOTHING,
            ElementwiseOp::Unary(u) if u.saves_output() => Saves::outputs(&[0]),
            ElementwiseOp::Unary(_) => Saves::inputs(&[0]),
            ElementwiseOp::Scalar(ScalarOp::RDiv, _) => Saves::inputs(&[0]).and_outputs(&[0]),
            ElementwiseOp::Scalar(ScalarOp::Pow, _) => Saves::inputs(&[0]),
            ElementwiseOp::Scalar(..) => Saves::NOTHING,
            ElementwiseOp::Binary(BinaryOp::Add | BinaryOp::Sub) => Saves::NOTHING,
            // d(a b) = b da + a db: each operand only for the other's gradient.
            ElementwiseOp::Binary(BinaryOp::Mul) => Saves::NOTHING
                .and_input_if(0, need(1))
                .and_input_if(1, need(0)),
            // d(a / b) = da / b - (a / b) db / b.
            ElementwiseOp::Binary(BinaryOp::Div) => Saves::inputs(&[1]).and_output_if(0, need(1)),
            ElementwiseOp::Cast(_)
            | ElementwiseOp::CastParts(_)
            | ElementwiseOp::UnaryBackward(_) => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let dy = g.dy()?;
        match self {
            ElementwiseOp::Unary(UnaryOp::Neg) => Grad::one(dy.neg()?),
            ElementwiseOp::Unary(u) if u.saves_output() => {
                Grad::one(dy.unary_backward(*u, g.output(0)?)?)
            }
            ElementwiseOp::Unary(u) => Grad::one(dy.unary_backward(*u, g.input(0)?)?),
            ElementwiseOp::Scalar(s, c) => {
                let c = c.get();
                Grad::one(match s {
                    ScalarOp::Add => dy.clone(),
                    ScalarOp::Mul => dy.mul_scalar(c)?,
                    ScalarOp::RSub => dy.neg()?,
                    // d(c / x) = -(c / x) / x
                    ScalarOp::RDiv => dy.mul(g.output(0)?)?.div(g.input(0)?)?.neg()?,
                    ScalarOp::Pow => dy.mul(&g.input(0)?.pow_scalar(c - 1.0)?)?.mul_scalar(c)?,
                })
            }
            ElementwiseOp::Binary(op) => {
                let (ga, gb) = match op {
                    BinaryOp::Add => (g.when(0, || Ok(dy.clone()))?, g.when(1, || Ok(dy.clone()))?),
                    BinaryOp::Sub => (g.when(0, || Ok(dy.clone()))?, g.when(1, || dy.neg())?),
                    BinaryOp::Mul => (
                        g.when(0, || dy.mul(g.input(1)?))?,
                        g.when(1, || dy.mul(g.input(0)?))?,
                    ),
                    BinaryOp::Div => (
                        g.when(0, || dy.div(g.input(1)?))?,
                        g.when(1, || dy.mul(g.output(0)?)?.div(g.input(1)?)?.neg())?,
                    ),
                };
                Ok(vec![
                    ga.map(|t| sum_to(t, g.input_meta(0))).transpose()?,
                    gb.map(|t| sum_to(t, g.input_meta(1))).transpose()?,
                ])
            }
            ElementwiseOp::Cast(_) => Grad::one(dy.cast(g.input_meta(0).dtype())?),
            ElementwiseOp::CastParts(_) => Grad::one(dy.to_dtype_parts(g.input_meta(0).dtype())?),
            ElementwiseOp::UnaryBackward(_) => Err(Grad::higher_order(self.name())),
        }
    }
}

impl<B: ElementwiseKernels> RunKernels<B> for ElementwiseOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        match self {
            ElementwiseOp::Unary(u) => b.unary(*u, x[0], y),
            ElementwiseOp::Scalar(s, c) => b.scalar(*s, c.get(), x[0], y),
            ElementwiseOp::Binary(op) => b.binary(*op, x[0], x[1], y),
            ElementwiseOp::Cast(_) | ElementwiseOp::CastParts(_) => b.cast(x[0], y),
            ElementwiseOp::UnaryBackward(u) => b.unary_backward(*u, x[0], x[1], y),
        }
    }
}
