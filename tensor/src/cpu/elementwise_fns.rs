//! The per-element functions of the element-wise ops on the CPU, one definition each, shared by
//! the element-wise kernels and the fused element-wise kernel (so a fused program computes
//! every element with the same arithmetic as the ops it replaces), and macros choosing one by
//! op as a function item, so the loop that calls it is compiled (and inlined) per function.
//! The same functions at one f64 value are public as [`UnaryOp::eval_f64`] and
//! [`UnaryOp::backward_f64`]: the host reference of device kernels.

use crate::element::{FloatElement, TensorElement};
use crate::op::UnaryOp;

/// GELU's cubic coefficient.
const GELU_K: f64 = 0.044715;

pub(crate) fn neg<F: FloatElement>(x: F) -> F {
    -x
}
pub(crate) fn relu<F: FloatElement>(x: F) -> F {
    let zero = F::from_f64(0.0);
    if x > zero {
        x
    } else {
        zero
    }
}
pub(crate) fn gelu<F: FloatElement>(x: F) -> F {
    let (one, half) = (F::one(), F::from_f64(0.5));
    let (c, k) = (
        F::from_f64((2.0 / std::f64::consts::PI).sqrt()),
        F::from_f64(GELU_K),
    );
    half * x * (one + (c * (x + k * x * x * x)).tanh())
}
pub(crate) fn exp<F: FloatElement>(x: F) -> F {
    x.exp()
}
pub(crate) fn log<F: FloatElement>(x: F) -> F {
    x.ln()
}
pub(crate) fn tanh<F: FloatElement>(x: F) -> F {
    x.tanh()
}
pub(crate) fn sigmoid<F: FloatElement>(x: F) -> F {
    let one = F::one();
    one / (one + (-x).exp())
}
pub(crate) fn sqrt<F: FloatElement>(x: F) -> F {
    x.sqrt()
}
pub(crate) fn abs<F: FloatElement>(x: F) -> F {
    x.abs()
}
pub(crate) fn square<F: FloatElement>(x: F) -> F {
    x * x
}

pub(crate) fn neg_backward<F: FloatElement>(g: F, _x: F) -> F {
    -g
}
pub(crate) fn relu_backward<F: FloatElement>(g: F, x: F) -> F {
    let zero = F::from_f64(0.0);
    if x > zero {
        g
    } else {
        zero
    }
}
pub(crate) fn gelu_backward<F: FloatElement>(g: F, x: F) -> F {
    let (one, half) = (F::one(), F::from_f64(0.5));
    let (c, k, k3) = (
        F::from_f64((2.0 / std::f64::consts::PI).sqrt()),
        F::from_f64(GELU_K),
        F::from_f64(3.0 * GELU_K),
    );
    let t = (c * (x + k * x * x * x)).tanh();
    g * (half * (one + t) + half * x * (one - t * t) * c * (one + k3 * x * x))
}
/// Exp, tanh and sigmoid read the forward output y (in `y`).
pub(crate) fn exp_backward<F: FloatElement>(g: F, y: F) -> F {
    g * y
}
pub(crate) fn log_backward<F: FloatElement>(g: F, x: F) -> F {
    g / x
}
pub(crate) fn tanh_backward<F: FloatElement>(g: F, y: F) -> F {
    g * (F::one() - y * y)
}
pub(crate) fn sigmoid_backward<F: FloatElement>(g: F, y: F) -> F {
    g * y * (F::one() - y)
}
pub(crate) fn sqrt_backward<F: FloatElement>(g: F, x: F) -> F {
    g * F::from_f64(0.5) / x.sqrt()
}
pub(crate) fn abs_backward<F: FloatElement>(g: F, x: F) -> F {
    let zero = F::from_f64(0.0);
    if x > zero {
        g
    } else if x < zero {
        -g
    } else {
        zero
    }
}
pub(crate) fn square_backward<F: FloatElement>(g: F, x: F) -> F {
    g * F::from_f64(2.0) * x
}

pub(crate) fn add_scalar<F: FloatElement>(x: F, c: F) -> F {
    x + c
}
pub(crate) fn mul_scalar<F: FloatElement>(x: F, c: F) -> F {
    x * c
}
pub(crate) fn rsub_scalar<F: FloatElement>(x: F, c: F) -> F {
    c - x
}
pub(crate) fn rdiv_scalar<F: FloatElement>(x: F, c: F) -> F {
    c / x
}
pub(crate) fn pow_scalar<F: FloatElement>(x: F, c: F) -> F {
    x.powf(c)
}

pub(crate) fn add<T: TensorElement>(p: T, q: T) -> T {
    p + q
}
pub(crate) fn sub<T: TensorElement>(p: T, q: T) -> T {
    p - q
}
pub(crate) fn mul<T: TensorElement>(p: T, q: T) -> T {
    p * q
}
pub(crate) fn div<T: TensorElement>(p: T, q: T) -> T {
    p / q
}

/// `$body` with `$f` the function item `elementwise_fns::$func::<$t>` of the arm `$arm` that
/// `$v` matches: the match every `with_*_fn` macro below makes over its op enum.
macro_rules! with_fn_of {
    ($v:expr, $t:ty, $f:ident => $body:expr; $($arm:pat => $func:ident),+ $(,)?) => {{
        use $crate::cpu::elementwise_fns as ef;
        match $v {
            $($arm => {
                let $f = ef::$func::<$t>;
                $body
            })+
        }
    }};
}
pub(crate) use with_fn_of;

/// `$body` with `$f` the forward (`forward`) or backward (`backward`) function of `UnaryOp`
/// `$u` on `$t`, from the one table of each unary op's two functions.
macro_rules! with_unary_table_fn {
    ($which:ident, $u:expr, $t:ty, $f:ident => $body:expr) => {
        $crate::cpu::elementwise_fns::with_unary_table_fn!(@pick $which, $u, $t, $f => $body;
            Neg => neg, neg_backward;
            Relu => relu, relu_backward;
            Gelu => gelu, gelu_backward;
            Exp => exp, exp_backward;
            Log => log, log_backward;
            Tanh => tanh, tanh_backward;
            Sigmoid => sigmoid, sigmoid_backward;
            Sqrt => sqrt, sqrt_backward;
            Abs => abs, abs_backward;
            Square => square, square_backward;
        )
    };
    (@pick forward, $u:expr, $t:ty, $f:ident => $body:expr;
        $($v:ident => $fwd:ident, $bwd:ident;)+) => {{
        use $crate::op::UnaryOp as U;
        $crate::cpu::elementwise_fns::with_fn_of!($u, $t, $f => $body; $(U::$v => $fwd),+)
    }};
    (@pick backward, $u:expr, $t:ty, $f:ident => $body:expr;
        $($v:ident => $fwd:ident, $bwd:ident;)+) => {{
        use $crate::op::UnaryOp as U;
        $crate::cpu::elementwise_fns::with_fn_of!($u, $t, $f => $body; $(U::$v => $bwd),+)
    }};
}
pub(crate) use with_unary_table_fn;

/// `$body` with `$f` the function of `UnaryOp` `$u` on element type `$t`.
macro_rules! with_unary_fn {
    ($u:expr, $t:ty, $f:ident => $body:expr) => {
        $crate::cpu::elementwise_fns::with_unary_table_fn!(forward, $u, $t, $f => $body)
    };
}
pub(crate) use with_unary_fn;

/// `$body` with `$f` the backward function `(dy, saved) -> dx` of `UnaryOp` `$u` on `$t`.
macro_rules! with_unary_backward_fn {
    ($u:expr, $t:ty, $f:ident => $body:expr) => {
        $crate::cpu::elementwise_fns::with_unary_table_fn!(backward, $u, $t, $f => $body)
    };
}
pub(crate) use with_unary_backward_fn;

impl UnaryOp {
    /// The function at one f64 value, computed as the CPU kernels compute it.
    pub fn eval_f64(self, x: f64) -> f64 {
        with_unary_fn!(self, f64, f => f(x))
    }
    /// `dx = dy f'(x)` at one f64 value, as the CPU kernels compute it; `saved` is y for the
    /// functions whose backward reads their output ([`UnaryOp::saves_output`]), else x.
    pub fn backward_f64(self, dy: f64, saved: f64) -> f64 {
        with_unary_backward_fn!(self, f64, f => f(dy, saved))
    }
}

/// `$body` with `$f` the function `(x, c) -> y` of `ScalarOp` `$s` on `$t`.
macro_rules! with_scalar_fn {
    ($s:expr, $t:ty, $f:ident => $body:expr) => {{
        use $crate::op::ScalarOp as S;
        $crate::cpu::elementwise_fns::with_fn_of!($s, $t, $f => $body;
            S::Add => add_scalar,
            S::Mul => mul_scalar,
            S::RSub => rsub_scalar,
            S::RDiv => rdiv_scalar,
            S::Pow => pow_scalar,
        )
    }};
}
pub(crate) use with_scalar_fn;

/// `$body` with `$f` the function `(p, q) -> r` of `BinaryOp` `$b` on `$t`.
macro_rules! with_binary_fn {
    ($b:expr, $t:ty, $f:ident => $body:expr) => {{
        use $crate::op::BinaryOp as B;
        $crate::cpu::elementwise_fns::with_fn_of!($b, $t, $f => $body;
            B::Add => add,
            B::Sub => sub,
            B::Mul => mul,
            B::Div => div,
        )
    }};
}
pub(crate) use with_binary_fn;
