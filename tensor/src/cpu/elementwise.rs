//! Element-wise CPU kernels: unary functions, scalar forms, broadcasting binary ops, casts and
//! the element-wise backward kernels; rayon for large arrays.

use ndarray::{ArrayD, IxDyn, Zip};
use oxiflow_sbp::Shape;

use super::{checked, CpuBackend};
use crate::element::{FloatElement, TensorElement};
use crate::op::{AdamPart, BinaryOp, ElementwiseKernels, OutSpec, ScalarOp, UnaryOp};
use crate::storage::CpuArray;
use crate::{Result, TensorError};

/// Arrays with at least this many elements run on rayon.
pub const PAR_THRESHOLD: usize = 1 << 15;

fn map<T: TensorElement>(a: &ArrayD<T>, f: impl Fn(T) -> T + Sync + Send) -> ArrayD<T> {
    if a.len() >= PAR_THRESHOLD {
        let mut out = a.to_owned();
        out.par_mapv_inplace(f);
        out
    } else if let Some(x) = a.as_slice() {
        let v: Vec<T> = x.iter().map(|&p| f(p)).collect();
        ArrayD::from_shape_vec(a.raw_dim(), v).unwrap_or_else(|_| a.mapv(f))
    } else {
        a.mapv(f)
    }
}

fn zip2<T: TensorElement>(
    a: &ArrayD<T>,
    b: &ArrayD<T>,
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Option<ArrayD<T>> {
    if a.shape() == b.shape() {
        // Contiguous operands of one shape: a plain loop over the slices (no n-d iteration).
        if let (Some(x), Some(y), true) = (a.as_slice(), b.as_slice(), a.len() < PAR_THRESHOLD) {
            let v: Vec<T> = x.iter().zip(y).map(|(&p, &q)| f(p, q)).collect();
            return ArrayD::from_shape_vec(a.raw_dim(), v).ok();
        }
        let z = Zip::from(a).and(b);
        return Some(if a.len() >= PAR_THRESHOLD {
            z.par_map_collect(|&x, &y| f(x, y))
        } else {
            z.map_collect(|&x, &y| f(x, y))
        });
    }
    let shape = crate::op::broadcast_shapes(&Shape::from(a.shape()), &Shape::from(b.shape()))?;
    let av = a.broadcast(IxDyn(shape.dims()))?;
    let bv = b.broadcast(IxDyn(shape.dims()))?;
    let z = Zip::from(&av).and(&bv);
    Some(if av.len() >= PAR_THRESHOLD {
        z.par_map_collect(|&x, &y| f(x, y))
    } else {
        z.map_collect(|&x, &y| f(x, y))
    })
}

fn float_unary<F: FloatElement>(u: UnaryOp, a: &ArrayD<F>) -> ArrayD<F> {
    let zero = F::from_f64(0.0);
    let one = F::one();
    let half = F::from_f64(0.5);
    let c = F::from_f64((2.0 / std::f64::consts::PI).sqrt());
    let k = F::from_f64(0.044715);
    match u {
        UnaryOp::Neg => map(a, |x| -x),
        UnaryOp::Relu => map(a, move |x| if x > zero { x } else { zero }),
        UnaryOp::Gelu => map(a, move |x| {
            half * x * (one + (c * (x + k * x * x * x)).tanh())
        }),
        UnaryOp::Exp => map(a, |x| x.exp()),
        UnaryOp::Log => map(a, |x| x.ln()),
        UnaryOp::Tanh => map(a, |x| x.tanh()),
        UnaryOp::Sigmoid => map(a, move |x| one / (one + (-x).exp())),
        UnaryOp::Sqrt => map(a, |x| x.sqrt()),
        UnaryOp::Abs => map(a, |x| x.abs()),
        UnaryOp::Square => map(a, |x| x * x),
    }
}

/// y = f(x).
pub fn unary(u: UnaryOp, a: &CpuArray) -> Result<CpuArray> {
    Ok(match a {
        CpuArray::F32(a) => CpuArray::F32(float_unary(u, a)),
        CpuArray::F64(a) => CpuArray::F64(float_unary(u, a)),
        CpuArray::I64(a) => CpuArray::I64(match u {
            UnaryOp::Neg => map(a, |x| x.wrapping_neg()),
            UnaryOp::Abs => map(a, |x| x.wrapping_abs()),
            UnaryOp::Square => map(a, |x| x.wrapping_mul(x)),
            UnaryOp::Relu => map(a, |x| x.max(0)),
            _ => {
                return Err(TensorError::Kernel {
                    op: u.name(),
                    detail: "needs a float input, got i64".into(),
                })
            }
        }),
    })
}

fn float_unary_backward<F: FloatElement>(
    u: UnaryOp,
    dy: &ArrayD<F>,
    x: &ArrayD<F>,
) -> Option<ArrayD<F>> {
    let zero = F::from_f64(0.0);
    let one = F::one();
    let half = F::from_f64(0.5);
    let two = F::from_f64(2.0);
    let c = F::from_f64((2.0 / std::f64::consts::PI).sqrt());
    let k = F::from_f64(0.044715);
    let k3 = F::from_f64(3.0 * 0.044715);
    match u {
        UnaryOp::Neg => zip2(dy, x, |g, _| -g),
        UnaryOp::Relu => zip2(dy, x, move |g, x| if x > zero { g } else { zero }),
        UnaryOp::Gelu => zip2(dy, x, move |g, x| {
            let t = (c * (x + k * x * x * x)).tanh();
            g * (half * (one + t) + half * x * (one - t * t) * c * (one + k3 * x * x))
        }),
        // Exp, tanh and sigmoid read the forward output y (in `x`).
        UnaryOp::Exp => zip2(dy, x, |g, y| g * y),
        UnaryOp::Log => zip2(dy, x, |g, x| g / x),
        UnaryOp::Tanh => zip2(dy, x, move |g, y| g * (one - y * y)),
        UnaryOp::Sigmoid => zip2(dy, x, move |g, y| g * y * (one - y)),
        UnaryOp::Sqrt => zip2(dy, x, move |g, x| g * half / x.sqrt()),
        UnaryOp::Abs => zip2(dy, x, move |g, x| {
            if x > zero {
                g
            } else if x < zero {
                -g
            } else {
                zero
            }
        }),
        UnaryOp::Square => zip2(dy, x, move |g, x| g * two * x),
    }
}

/// dx = dy * f'(x), from the forward input x, or for exp, tanh and sigmoid the output y.
pub fn unary_backward(u: UnaryOp, dy: &CpuArray, x: &CpuArray) -> Result<CpuArray> {
    let out = match (dy, x) {
        (CpuArray::F32(g), CpuArray::F32(x)) => float_unary_backward(u, g, x).map(CpuArray::F32),
        (CpuArray::F64(g), CpuArray::F64(x)) => float_unary_backward(u, g, x).map(CpuArray::F64),
        _ => None,
    };
    out.ok_or_else(|| TensorError::Kernel {
        op: u.backward_name(),
        detail: format!(
            "needs float dy and x of one shape, got {:?} and {:?}",
            dy.shape(),
            x.shape()
        ),
    })
}

fn adam_t<F: FloatElement>(part: AdamPart, x: &[&ArrayD<F>]) -> Option<ArrayD<F>> {
    let n = if matches!(part, AdamPart::Update { .. }) {
        3
    } else {
        2
    };
    if x.len() != n || x.iter().any(|a| a.shape() != x[0].shape()) {
        return None;
    }
    let [a, b, c, d] = part.coefficients().map(F::from_f64);
    let big = x[0].len() >= PAR_THRESHOLD;
    Some(match part {
        AdamPart::Moment1 { .. } | AdamPart::Moment2 { .. } => {
            let sq = matches!(part, AdamPart::Moment2 { .. });
            let f = move |&m: &F, &g: &F| m * a + if sq { g * g } else { g } * b;
            let z = Zip::from(x[0]).and(x[1]);
            if big {
                z.par_map_collect(f)
            } else {
                z.map_collect(f)
            }
        }
        AdamPart::Update { .. } => {
            let f = move |&p: &F, &m: &F, &v: &F| p * a - (m * b) / ((v * c).sqrt() + d);
            let z = Zip::from(x[0]).and(x[1]).and(x[2]);
            if big {
                z.par_map_collect(f)
            } else {
                z.map_collect(f)
            }
        }
    })
}

/// One fused AdamW piece (see `AdamPart`) on same-shape float arrays of one dtype.
pub fn adam(part: AdamPart, x: &[&CpuArray]) -> Result<CpuArray> {
    let f32s: Option<Vec<_>> = x
        .iter()
        .map(|a| match a {
            CpuArray::F32(v) => Some(v),
            _ => None,
        })
        .collect();
    let f64s: Option<Vec<_>> = x
        .iter()
        .map(|a| match a {
            CpuArray::F64(v) => Some(v),
            _ => None,
        })
        .collect();
    let out = match (f32s, f64s) {
        (Some(v), _) => adam_t(part, &v).map(CpuArray::F32),
        (_, Some(v)) => adam_t(part, &v).map(CpuArray::F64),
        _ => None,
    };
    out.ok_or_else(|| TensorError::Kernel {
        op: part.name(),
        detail: format!(
            "needs float operands of one dtype and shape, got {:?}",
            x.iter()
                .map(|a| (a.dtype(), a.shape().to_vec()))
                .collect::<Vec<_>>()
        ),
    })
}

fn float_scalar<F: FloatElement>(s: ScalarOp, a: &ArrayD<F>, c: f64) -> ArrayD<F> {
    let c = F::from_f64(c);
    match s {
        ScalarOp::Add => map(a, move |x| x + c),
        ScalarOp::Mul => map(a, move |x| x * c),
        ScalarOp::RSub => map(a, move |x| c - x),
        ScalarOp::RDiv => map(a, move |x| c / x),
        ScalarOp::Pow => map(a, move |x| x.powf(c)),
    }
}

/// y = x (op) c.
pub fn scalar(s: ScalarOp, a: &CpuArray, c: f64) -> Result<CpuArray> {
    Ok(match a {
        CpuArray::F32(a) => CpuArray::F32(float_scalar(s, a, c)),
        CpuArray::F64(a) => CpuArray::F64(float_scalar(s, a, c)),
        CpuArray::I64(a) => {
            let ci = c as i64;
            CpuArray::I64(match s {
                ScalarOp::Add => map(a, move |x| x.wrapping_add(ci)),
                ScalarOp::Mul => map(a, move |x| x.wrapping_mul(ci)),
                ScalarOp::RSub => map(a, move |x| ci.wrapping_sub(x)),
                ScalarOp::RDiv | ScalarOp::Pow => {
                    return Err(TensorError::Kernel {
                        op: s.name(),
                        detail: "needs a float input, got i64".into(),
                    })
                }
            })
        }
    })
}

fn typed_binary<T: TensorElement>(b: BinaryOp, x: &ArrayD<T>, y: &ArrayD<T>) -> Option<ArrayD<T>> {
    match b {
        BinaryOp::Add => zip2(x, y, |p, q| p + q),
        BinaryOp::Sub => zip2(x, y, |p, q| p - q),
        BinaryOp::Mul => zip2(x, y, |p, q| p * q),
        BinaryOp::Div => zip2(x, y, |p, q| p / q),
    }
}

/// Broadcasting z = x (op) y.
pub fn binary(b: BinaryOp, x: &CpuArray, y: &CpuArray) -> Result<CpuArray> {
    let out = match (x, y) {
        (CpuArray::F32(p), CpuArray::F32(q)) => typed_binary(b, p, q).map(CpuArray::F32),
        (CpuArray::F64(p), CpuArray::F64(q)) => typed_binary(b, p, q).map(CpuArray::F64),
        (CpuArray::I64(p), CpuArray::I64(q)) if b != BinaryOp::Div || q.iter().all(|&v| v != 0) => {
            typed_binary(b, p, q).map(CpuArray::I64)
        }
        _ => None,
    };
    out.ok_or_else(|| TensorError::Kernel {
        op: b.name(),
        detail: format!(
            "local pieces {:?} ({}) and {:?} ({}) do not fit (or an integer division by zero)",
            x.shape(),
            x.dtype(),
            y.shape(),
            y.dtype()
        ),
    })
}

impl ElementwiseKernels for CpuBackend {
    fn unary(&self, u: UnaryOp, x: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked(u.name(), unary(u, x)?, out)
    }
    fn scalar(&self, s: ScalarOp, c: f64, x: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked(s.name(), scalar(s, x, c)?, out)
    }
    fn binary(&self, b: BinaryOp, x: &CpuArray, y: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked(b.name(), binary(b, x, y)?, out)
    }
    fn cast(&self, x: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked("cast", x.cast(out.dtype), out)
    }
    fn unary_backward(
        &self,
        u: UnaryOp,
        dy: &CpuArray,
        x: &CpuArray,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        checked(u.backward_name(), unary_backward(u, dy, x)?, out)
    }
    fn adam(&self, part: AdamPart, x: &[&CpuArray], out: &OutSpec) -> Result<CpuArray> {
        checked(part.name(), adam(part, x)?, out)
    }
}
