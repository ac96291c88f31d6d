//! Backward rules: the input gradients of each op from its output gradient, written with
//! ordinary (dispatched) ops so global gradients get their nd-SBP by signature inference.

use oxiflow_sbp::{NdSbp, Sbp, Shape};

use crate::op::{BinaryOp, Op, ScalarOp, UnaryOp};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

use super::node::{Node, NodeKind};

/// Zeros of `shape` with `like`'s dtype, on `like`'s placement (all-B) or local.
fn zeros_on(like: &Tensor, shape: Shape) -> Result<Tensor> {
    match (like.placement(), like.context()) {
        (Some(p), Some(ctx)) => {
            let _g = ctx.install();
            Tensor::zeros_global(shape, like.dtype(), p, NdSbp::broadcast(p.ndim()))
        }
        _ => Ok(Tensor::zeros(shape, like.dtype())),
    }
}

/// Zeros in `like`'s own layout (same shape, dtype, placement, nd-SBP).
fn zeros_like(like: &Tensor) -> Result<Tensor> {
    match (like.placement(), like.context(), like.nd_sbp()) {
        (Some(p), Some(ctx), Some(s)) => {
            let _g = ctx.install();
            Tensor::zeros_global(like.shape().clone(), like.dtype(), p, s.clone())
        }
        _ => Ok(Tensor::zeros(like.shape().clone(), like.dtype())),
    }
}

/// `dy` of a reduction over `dims` (without keepdim) reshaped to the keepdim shape.
fn keepdim_shape(x: &Shape, dims: &[usize]) -> Shape {
    Shape::new(
        x.dims()
            .iter()
            .enumerate()
            .map(|(i, &d)| if dims.contains(&i) { 1 } else { d }),
    )
}

/// `dy` broadcast back to `x`'s shape (the gradient of a reduction over `dims`).
fn expand_reduced(dy: &Tensor, x: &Tensor, dims: &[usize], keepdim: bool) -> Result<Tensor> {
    let dyk = if keepdim {
        dy.clone()
    } else {
        dy.reshape(keepdim_shape(x.shape(), dims))?
    };
    zeros_like(x)?.add(&dyk)
}

fn sum_to(g: Tensor, like: &Tensor) -> Result<Tensor> {
    g.sum_to_shape(like.shape().clone())
}

/// Matrix transpose of the last two dims.
fn t(x: &Tensor) -> Result<Tensor> {
    x.transpose(-2, -1)
}

fn unsupported(op: &Op, why: &str) -> TensorError {
    TensorError::Autograd {
        op: "backward",
        detail: format!("{} is not differentiable: {why}", op.name()),
    }
}

/// Input gradients of `node` given the gradient `dy` of its output (None where not needed).
pub(crate) fn backward(node: &Node, dy: &Tensor) -> Result<Vec<Option<Tensor>>> {
    let x: Vec<Tensor> = node.inputs.iter().map(Tensor::detach).collect();
    let need = |i: usize| node.needs.get(i).copied().unwrap_or(false);
    let out = &node.output;
    let op = match &node.kind {
        NodeKind::ToGlobal { nd_sbp, .. } => {
            return Ok(vec![Some(to_global_backward(&x[0], dy, nd_sbp)?)])
        }
        NodeKind::Op(op) => op,
    };
    let one = |g: Tensor| Ok(vec![Some(g)]);
    match op {
        Op::Unary(UnaryOp::Neg) => one(dy.neg()?),
        Op::Unary(u) => one(dy.unary_backward(*u, &x[0])?),
        Op::Scalar(s, c) => {
            let c = c.get();
            one(match s {
                ScalarOp::Add => dy.clone(),
                ScalarOp::Mul => dy.mul_scalar(c)?,
                ScalarOp::RSub => dy.neg()?,
                // d(c / x) = -(c / x) / x
                ScalarOp::RDiv => dy.mul(out)?.div(&x[0])?.neg()?,
                ScalarOp::Pow => dy.mul(&x[0].pow_scalar(c - 1.0)?)?.mul_scalar(c)?,
            })
        }
        Op::Binary(b) => {
            let (a, bb) = (&x[0], &x[1]);
            let (ga, gb) = match b {
                BinaryOp::Add => (need(0).then(|| dy.clone()), need(1).then(|| dy.clone())),
                BinaryOp::Sub => (
                    need(0).then(|| dy.clone()),
                    if need(1) { Some(dy.neg()?) } else { None },
                ),
                BinaryOp::Mul => (
                    if need(0) { Some(dy.mul(bb)?) } else { None },
                    if need(1) { Some(dy.mul(a)?) } else { None },
                ),
                BinaryOp::Div => (
                    if need(0) { Some(dy.div(bb)?) } else { None },
                    if need(1) {
                        Some(dy.mul(out)?.div(bb)?.neg()?)
                    } else {
                        None
                    },
                ),
            };
            Ok(vec![
                ga.map(|g| sum_to(g, a)).transpose()?,
                gb.map(|g| sum_to(g, bb)).transpose()?,
            ])
        }
        Op::MatMul => {
            let (a, b) = (&x[0], &x[1]);
            let ga = if need(0) {
                Some(dy.matmul(&t(b)?)?)
            } else {
                None
            };
            let gb = if need(1) {
                let k = b.shape().dim(0);
                let n = b.shape().dim(1);
                let (a2, dy2) = if a.ndim() == 2 {
                    (a.clone(), dy.clone())
                } else {
                    let m = a.numel() / k.max(1);
                    (a.reshape([m, k])?, dy.reshape([m, n])?)
                };
                Some(t(&a2)?.matmul(&dy2)?)
            } else {
                None
            };
            Ok(vec![ga, gb])
        }
        Op::BatchMatMul => {
            let (a, b) = (&x[0], &x[1]);
            let ga = if need(0) { Some(dy.bmm(&t(b)?)?) } else { None };
            let gb = if need(1) { Some(t(a)?.bmm(dy)?) } else { None };
            Ok(vec![ga, gb])
        }
        Op::Sum { dims, keepdim } => one(expand_reduced(dy, &x[0], dims, *keepdim)?),
        Op::Mean { dims, keepdim, .. } => {
            let count: usize = dims
                .iter()
                .map(|&d| x[0].shape().dim(d))
                .product::<usize>()
                .max(1);
            one(expand_reduced(dy, &x[0], dims, *keepdim)?.mul_scalar(1.0 / count as f64)?)
        }
        Op::Max { dims, keepdim } => {
            // Gradient split evenly among the maxima: mask = (x == max) as 1 - sign(x - max)^2.
            let xs = &x[0];
            let yk = if *keepdim {
                out.clone()
            } else {
                out.reshape(keepdim_shape(xs.shape(), dims))?
            };
            let diff = xs.sub(&yk)?;
            let ones = zeros_like(xs)?.add_scalar(1.0)?;
            let mask = ones
                .unary_backward(UnaryOp::Abs, &diff)?
                .square()?
                .rsub_scalar(1.0)?;
            let dimsi: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
            let count = mask.sum(&dimsi, true)?;
            let dyk = if *keepdim {
                dy.clone()
            } else {
                dy.reshape(keepdim_shape(xs.shape(), dims))?
            };
            one(mask.mul(&dyk.div(&count)?)?)
        }
        Op::Softmax { dim } => one(Tensor::softmax_backward(out, dy, *dim as isize)?),
        Op::LogSoftmax { dim } => one(Tensor::log_softmax_backward(out, dy, *dim as isize)?),
        Op::Permute { perm } => {
            let mut inv = vec![0usize; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            one(dy.permute(&inv)?)
        }
        Op::Reshape { .. } => one(dy.reshape(x[0].shape().clone())?),
        Op::Concat { dim } => {
            let mut start = 0;
            let mut gs = Vec::with_capacity(x.len());
            for (i, xi) in x.iter().enumerate() {
                let len = xi.shape().dim(*dim);
                gs.push(if need(i) {
                    Some(dy.narrow(*dim as isize, start, len)?)
                } else {
                    None
                });
                start += len;
            }
            Ok(gs)
        }
        Op::Narrow { dim, start, len } => {
            let full = x[0].shape();
            let total = full.dim(*dim);
            let part = |n: usize| {
                let mut d = full.dims().to_vec();
                d[*dim] = n;
                zeros_on(dy, Shape::new(d))
            };
            let before = (*start > 0).then(|| part(*start)).transpose()?;
            let rest = total.saturating_sub(start + len);
            let after = (rest > 0).then(|| part(rest)).transpose()?;
            let mut parts: Vec<&Tensor> = Vec::new();
            parts.extend(before.as_ref());
            parts.push(dy);
            parts.extend(after.as_ref());
            one(if parts.len() == 1 {
                dy.clone()
            } else {
                Tensor::concat(&parts, *dim as isize)?
            })
        }
        Op::Embedding => {
            let num = x[1].shape().dim(0);
            Ok(vec![
                None,
                Some(Tensor::embedding_backward(&x[0], dy, num)?),
            ])
        }
        Op::LayerNorm { eps } => {
            let (xs, w, b) = (&x[0], &x[1], &x[2]);
            let gx = if need(0) {
                Some(Tensor::layer_norm_backward(xs, w, dy, eps.get())?)
            } else {
                None
            };
            let gw = if need(1) {
                let ones = zeros_like(w)?.add_scalar(1.0)?;
                let xhat = xs.layer_norm(&ones, &zeros_like(b)?, eps.get())?;
                Some(sum_to(xhat.mul(dy)?, w)?)
            } else {
                None
            };
            let gb = if need(2) {
                Some(sum_to(dy.clone(), b)?)
            } else {
                None
            };
            Ok(vec![gx, gw, gb])
        }
        Op::CrossEntropy => Ok(vec![
            Some(Tensor::cross_entropy_backward(&x[0], &x[1], dy)?),
            None,
        ]),
        Op::Cast(_) => one(dy.cast(x[0].dtype())?),
        Op::UnaryBackward(_)
        | Op::SoftmaxBackward { .. }
        | Op::LogSoftmaxBackward { .. }
        | Op::SumToShape { .. }
        | Op::EmbeddingBackward { .. }
        | Op::LayerNormBackward { .. }
        | Op::CrossEntropyBackward => match op {
            // sum_to_shape is linear: its backward broadcasts dy back.
            Op::SumToShape { .. } => one(zeros_like(&x[0])?.add(dy)?),
            _ => Err(unsupported(op, "higher-order gradients are not supported")),
        },
    }
}

/// Gradient of `to_global`: the output gradient boxed back to the input's layout. A local input
/// (this rank's piece) gets its piece of the gradient, partial-sum axes read as broadcast.
fn to_global_backward(x: &Tensor, dy: &Tensor, target: &NdSbp) -> Result<Tensor> {
    if let (Some(p), Some(s)) = (x.placement(), x.nd_sbp()) {
        return dy.to_global(p, s.clone());
    }
    let Some(p) = dy.placement() else {
        return Ok(dy.clone());
    };
    let piece_sbp = NdSbp::new(
        target
            .iter()
            .map(|s| if s.is_partial() { Sbp::B } else { s }),
    );
    Ok(dy.to_global(p, piece_sbp)?.to_local())
}
