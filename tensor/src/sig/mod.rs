//! Op metadata: shape/dtype inference (`meta`) and the mapping of tensor ops onto the
//! `OpKind`s of `oxiflow_sbp`'s signature inference.

pub mod meta;

use oxiflow_sbp::{BinaryOp as SbpBinary, OpKind, ReduceKind};

use crate::op::{BinaryOp, Dims, Op, ScalarOp};

fn sorted(dims: &Dims) -> Dims {
    let mut d = dims.clone();
    d.sort_unstable();
    d.dedup();
    d
}

/// The signature-inference op of `op`. Input orders agree (the tensor ops are defined in the
/// order `OpKind` documents), so inputs and outputs map one to one; an op with fewer outputs
/// uses `outputs[0]`.
pub fn op_kind(op: &Op) -> OpKind {
    match op {
        Op::Unary(u) => OpKind::Unary {
            linear: u.is_linear(),
        },
        Op::Scalar(s, _) => OpKind::Unary {
            linear: *s == ScalarOp::Mul,
        },
        Op::Cast(_) => OpKind::Unary { linear: false },
        Op::Binary(b) => OpKind::Binary(match b {
            BinaryOp::Add => SbpBinary::Add,
            BinaryOp::Sub => SbpBinary::Sub,
            BinaryOp::Mul => SbpBinary::Mul,
            BinaryOp::Div => SbpBinary::Div,
        }),
        Op::MatMul => OpKind::MatMul,
        Op::BatchMatMul => OpKind::BatchMatMul,
        Op::Sum { dims, keepdim } => OpKind::Reduce {
            kind: ReduceKind::Sum,
            dims: sorted(dims),
            keepdim: *keepdim,
        },
        Op::Mean { dims, keepdim, .. } => OpKind::Reduce {
            kind: ReduceKind::Mean,
            dims: sorted(dims),
            keepdim: *keepdim,
        },
        Op::Max { dims, keepdim } => OpKind::Reduce {
            kind: ReduceKind::Max,
            dims: sorted(dims),
            keepdim: *keepdim,
        },
        Op::Softmax { dim } => OpKind::Softmax { dim: *dim },
        Op::LogSoftmax { dim } => OpKind::LogSoftmax { dim: *dim },
        Op::Permute { perm } => OpKind::Permute { perm: perm.clone() },
        Op::Reshape { shape } => OpKind::Reshape {
            shape: shape.clone(),
        },
        Op::Concat { dim } => OpKind::Concat { dim: *dim },
        Op::Narrow { dim, start, len } => OpKind::Slice {
            dim: *dim,
            start: *start,
            end: start + len,
        },
        Op::Embedding => OpKind::Embedding,
        Op::LayerNorm { .. } => OpKind::LayerNorm { normalized_dims: 1 },
        Op::CrossEntropy => OpKind::CrossEntropy,
        // dx = dy * f'(x): linear in dy, not in x; Div's table ((P, B) -> P only) is exactly that.
        Op::UnaryBackward(_) => OpKind::Binary(SbpBinary::Div),
        Op::SoftmaxBackward { dim } => OpKind::SoftmaxBackward { dim: *dim },
        Op::LogSoftmaxBackward { dim } => OpKind::LogSoftmaxBackward { dim: *dim },
        Op::SumToShape { shape } => OpKind::ReduceToShape {
            shape: shape.clone(),
        },
        Op::EmbeddingBackward { num } => OpKind::EmbeddingBackward {
            num_embeddings: *num,
        },
        Op::LayerNormBackward { .. } => OpKind::LayerNormBackward { normalized_dims: 1 },
        Op::CrossEntropyBackward => OpKind::CrossEntropyBackward,
    }
}
