//! CPU kernels: one entry point, `run_cpu`, that runs an op (with local attributes) on local pieces.

pub mod elementwise;
pub mod matmul;
pub mod nn;
pub mod reduce;
pub mod shape;

use crate::op::Op;
use crate::storage::CpuArray;
use crate::Result;

/// Runs `op` on host pieces. The caller has checked arity, shapes and dtypes; kernels still
/// return typed errors (never panic) on data they cannot handle (e.g. out-of-range indices).
pub fn run_cpu(op: &Op, x: &[&CpuArray]) -> Result<CpuArray> {
    let out = match op {
        Op::Unary(u) => elementwise::unary(*u, x[0])?,
        Op::Scalar(s, c) => elementwise::scalar(*s, x[0], c.get())?,
        Op::Binary(b) => elementwise::binary(*b, x[0], x[1])?,
        Op::Cast(dt) => x[0].cast(*dt),
        Op::MatMul => matmul::matmul(x[0], x[1])?,
        Op::BatchMatMul => matmul::batch_matmul(x[0], x[1])?,
        Op::Sum { dims, keepdim } => reduce::reduce(x[0], dims, *keepdim, false),
        Op::Max { dims, keepdim } => reduce::reduce(x[0], dims, *keepdim, true),
        Op::Mean {
            dims,
            keepdim,
            count,
        } => reduce::mean(x[0], dims, *keepdim, *count)?,
        Op::Softmax { dim } => reduce::softmax(x[0], *dim, false)?,
        Op::LogSoftmax { dim } => reduce::softmax(x[0], *dim, true)?,
        Op::Permute { perm } => shape::permute(x[0], perm),
        Op::Reshape { shape } => shape::reshape(x[0], shape.dims())?,
        Op::Concat { dim } => shape::concat(x, *dim)?,
        Op::Narrow { dim, start, len } => shape::narrow(x[0], *dim, *start, *len)?,
        Op::Embedding => nn::embedding(x[1], x[0])?,
        Op::LayerNorm { eps } => nn::layer_norm(x[0], Some(x[1]), Some(x[2]), eps.get())?,
        Op::CrossEntropy => nn::cross_entropy(x[0], x[1])?,
        Op::UnaryBackward(u) => elementwise::unary_backward(*u, x[0], x[1])?,
        Op::SoftmaxBackward { dim } => reduce::softmax_backward(x[1], x[0], *dim, false)?,
        Op::LogSoftmaxBackward { dim } => reduce::softmax_backward(x[1], x[0], *dim, true)?,
        Op::SumToShape { shape } => reduce::sum_to_shape(x[0], shape.dims())?,
        Op::EmbeddingBackward { num } => nn::embedding_backward(x[1], x[0], *num)?,
        Op::LayerNormBackward { eps } => {
            nn::layer_norm_backward(x[2], x[0], Some(x[1]), eps.get())?
        }
        Op::CrossEntropyBackward => nn::cross_entropy_backward(x[2], x[0], x[1])?,
    };
    Ok(out.into_standard())
}
