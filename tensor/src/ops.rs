//! The op methods of `Tensor`: each builds an `Op` and calls `dispatch`, so the same call works
//! on local and global tensors (and autograd can wrap every one through the dispatch hook).

use oxiflow_collectives::DType;
use oxiflow_sbp::Shape;

use crate::dispatch::{dispatch, sbps_text};
use crate::op::{BinaryOp, Dims, F64Bits, Op, ScalarOp, UnaryOp};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

/// Normalizes a possibly negative dim of a tensor with `ndim` dims.
fn norm_dim(op: &'static str, t: &Tensor, d: isize) -> Result<usize> {
    let n = t.ndim() as isize;
    let v = if d < 0 { d + n } else { d };
    if v < 0 || v >= n.max(1) || (n == 0) {
        return Err(TensorError::Shape {
            op,
            shapes: t.shape().to_string(),
            sbps: sbps_text(&[t]),
            detail: format!("dim {d} out of range for {n} dims"),
        });
    }
    Ok(v as usize)
}

fn norm_dims(op: &'static str, t: &Tensor, dims: &[isize]) -> Result<Dims> {
    let mut out = Dims::new();
    for &d in dims {
        let v = norm_dim(op, t, d)?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out.sort_unstable();
    Ok(out)
}

macro_rules! unary_methods {
    ($($name:ident => $u:ident),* $(,)?) => {
        $(
            #[doc = concat!("Element-wise `", stringify!($name), "`.")]
            pub fn $name(&self) -> Result<Tensor> {
                dispatch(Op::Unary(UnaryOp::$u), &[self])
            }
        )*
    };
}

impl Tensor {
    unary_methods!(neg => Neg, relu => Relu, gelu => Gelu, exp => Exp, log => Log, tanh => Tanh,
        sigmoid => Sigmoid, sqrt => Sqrt, abs => Abs, square => Square);

    /// Any element-wise unary function.
    pub fn unary(&self, u: UnaryOp) -> Result<Tensor> {
        dispatch(Op::Unary(u), &[self])
    }
    fn scalar_op(&self, s: ScalarOp, c: f64) -> Result<Tensor> {
        dispatch(Op::Scalar(s, F64Bits::new(c)), &[self])
    }
    /// x * c (linear: keeps a partial-sum SBP).
    pub fn scale(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Mul, c)
    }
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Mul, c)
    }
    pub fn div_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Mul, 1.0 / c)
    }
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Add, c)
    }
    pub fn sub_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Add, -c)
    }
    /// c - x
    pub fn rsub_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::RSub, c)
    }
    /// c / x
    pub fn rdiv_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::RDiv, c)
    }
    /// x ^ c
    pub fn pow_scalar(&self, c: f64) -> Result<Tensor> {
        self.scalar_op(ScalarOp::Pow, c)
    }

    /// Broadcasting add.
    pub fn add(&self, o: &Tensor) -> Result<Tensor> {
        dispatch(Op::Binary(BinaryOp::Add), &[self, o])
    }
    pub fn sub(&self, o: &Tensor) -> Result<Tensor> {
        dispatch(Op::Binary(BinaryOp::Sub), &[self, o])
    }
    pub fn mul(&self, o: &Tensor) -> Result<Tensor> {
        dispatch(Op::Binary(BinaryOp::Mul), &[self, o])
    }
    pub fn div(&self, o: &Tensor) -> Result<Tensor> {
        dispatch(Op::Binary(BinaryOp::Div), &[self, o])
    }

    /// Matrix product. `b` 2-d: `self [.., k] @ b [k, n]`; otherwise batch matmul with equal
    /// batch dims. (A global `self` of other than 2 dims goes through a reshape to 2-d.)
    pub fn matmul(&self, b: &Tensor) -> Result<Tensor> {
        if b.ndim() != 2 {
            return dispatch(Op::BatchMatMul, &[self, b]);
        }
        if self.is_global() && self.ndim() != 2 && self.ndim() > 0 {
            let dims = self.shape().dims();
            let k = dims[dims.len() - 1];
            let m: usize = dims[..dims.len() - 1].iter().product();
            let y = self.reshape([m, k])?.matmul(b)?;
            let mut out = dims.to_vec();
            let last = out.len() - 1;
            out[last] = b.shape().dim(1);
            return y.reshape(out);
        }
        dispatch(Op::MatMul, &[self, b])
    }
    /// Batch matmul `[b.., m, k] @ [b.., k, n]`.
    pub fn bmm(&self, b: &Tensor) -> Result<Tensor> {
        dispatch(Op::BatchMatMul, &[self, b])
    }

    /// Sum over `dims` (negative dims count from the end).
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = norm_dims("sum", self, dims)?;
        dispatch(Op::Sum { dims, keepdim }, &[self])
    }
    /// Sum of all elements (0-d result).
    pub fn sum_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.ndim() as isize).collect();
        self.sum(&dims, false)
    }
    /// Mean over `dims`: the sum times 1 / (the global count of reduced elements).
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = norm_dims("mean", self, dims)?;
        dispatch(
            Op::Mean {
                dims,
                keepdim,
                count: 0,
            },
            &[self],
        )
    }
    pub fn mean_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.ndim() as isize).collect();
        self.mean(&dims, false)
    }
    /// Max over `dims`.
    pub fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = norm_dims("max", self, dims)?;
        dispatch(Op::Max { dims, keepdim }, &[self])
    }
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let dim = norm_dim("softmax", self, dim)?;
        dispatch(Op::Softmax { dim }, &[self])
    }
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let dim = norm_dim("log_softmax", self, dim)?;
        dispatch(Op::LogSoftmax { dim }, &[self])
    }

    /// Output dim i is input dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        dispatch(
            Op::Permute {
                perm: perm.iter().copied().collect(),
            },
            &[self],
        )
    }
    /// Swaps two dims.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let (a, b) = (
            norm_dim("transpose", self, d0)?,
            norm_dim("transpose", self, d1)?,
        );
        let mut perm: Dims = (0..self.ndim()).collect();
        perm.swap(a, b);
        dispatch(Op::Permute { perm }, &[self])
    }
    /// Row-major reshape (same element count).
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        dispatch(
            Op::Reshape {
                shape: shape.into(),
            },
            &[self],
        )
    }
    /// Concatenates tensors along `dim`.
    pub fn concat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return Err(TensorError::Shape {
                op: "concat",
                shapes: String::new(),
                sbps: String::new(),
                detail: "no inputs".into(),
            });
        };
        let dim = norm_dim("concat", first, dim)?;
        dispatch(Op::Concat { dim }, tensors)
    }
    /// Elements `start..start + len` of `dim`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let dim = norm_dim("narrow", self, dim)?;
        dispatch(Op::Narrow { dim, start, len }, &[self])
    }
    /// Elements `start..end` of `dim`.
    pub fn slice(&self, dim: isize, start: usize, end: usize) -> Result<Tensor> {
        self.narrow(dim, start, end.saturating_sub(start))
    }
    /// Converts the element type.
    pub fn cast(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        dispatch(Op::Cast(dtype), &[self])
    }

    /// Rows of `weight [V, H]` at `ids [..]` (i64) -> `[.., H]`.
    pub fn embedding(ids: &Tensor, weight: &Tensor) -> Result<Tensor> {
        dispatch(Op::Embedding, &[ids, weight])
    }
    /// Layer norm over the last dim with weight and bias `[H]`.
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        dispatch(
            Op::LayerNorm {
                eps: F64Bits::new(eps),
            },
            &[self, weight, bias],
        )
    }
    /// Per-sample cross-entropy of logits `[N, C]` against labels `[N]` (i64) -> `[N]`.
    pub fn cross_entropy(&self, labels: &Tensor) -> Result<Tensor> {
        dispatch(Op::CrossEntropy, &[self, labels])
    }

    // ---- backward kernels (ordinary ops, so gradients of global tensors get their SBP too) ----

    /// dx = dy * f'(x) for y = f(x) (`self` is dy).
    pub fn unary_backward(&self, u: UnaryOp, x: &Tensor) -> Result<Tensor> {
        dispatch(Op::UnaryBackward(u), &[self, x])
    }
    /// dx of y = softmax(x, dim) from y and dy.
    pub fn softmax_backward(y: &Tensor, dy: &Tensor, dim: isize) -> Result<Tensor> {
        let dim = norm_dim("softmax_backward", y, dim)?;
        dispatch(Op::SoftmaxBackward { dim }, &[y, dy])
    }
    /// dx of y = log_softmax(x, dim) from y and dy.
    pub fn log_softmax_backward(y: &Tensor, dy: &Tensor, dim: isize) -> Result<Tensor> {
        let dim = norm_dim("log_softmax_backward", y, dim)?;
        dispatch(Op::LogSoftmaxBackward { dim }, &[y, dy])
    }
    /// Sums broadcast dims away so the result has `shape` (gradient of broadcasting).
    pub fn sum_to_shape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        dispatch(Op::SumToShape { shape }, &[self])
    }
    /// Weight gradient `[num, H]` of an embedding lookup: scatter-add of dy rows at ids.
    pub fn embedding_backward(ids: &Tensor, dy: &Tensor, num: usize) -> Result<Tensor> {
        dispatch(Op::EmbeddingBackward { num }, &[ids, dy])
    }
    /// dx of layer norm over the last dim.
    pub fn layer_norm_backward(
        x: &Tensor,
        weight: &Tensor,
        dy: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        dispatch(
            Op::LayerNormBackward {
                eps: F64Bits::new(eps),
            },
            &[x, weight, dy],
        )
    }
    /// dlogits of the per-sample cross-entropy, given dloss `[N]`.
    pub fn cross_entropy_backward(logits: &Tensor, labels: &Tensor, dy: &Tensor) -> Result<Tensor> {
        dispatch(Op::CrossEntropyBackward, &[logits, labels, dy])
    }
}
