//! `OpKind`: the closed set of ops signature inference knows, with their attributes.

use std::fmt;

use smallvec::SmallVec;

use crate::Shape;

/// A list of tensor dims (reduce dims, permutations).
pub type Dims = SmallVec<[usize; 6]>;

/// Element-wise binary ops (numpy broadcasting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

/// Reductions over a set of dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceKind {
    Sum,
    /// Sum, then scale by the *global* count of reduced elements: the local kernel of a mean
    /// divides its local sum by the count taken from the global input shape, so a split reduce
    /// dim yields a partial sum of the global mean.
    Mean,
    Max,
    Min,
}

/// The ops signature inference knows. Dims are non-negative (the tensor layer normalises
/// negative dims first). Inputs of every op are listed in the doc of its variant; every op has
/// one output unless said otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `a [m, k] @ b [k, n] -> [m, n]`.
    MatMul,
    /// `a [..batch, m, k] @ b [..batch, k, n] -> [..batch, m, n]`; batch dims equal.
    BatchMatMul,
    /// Element-wise unary op. `linear` (neg, scale) lets partial sums through; relu, gelu, exp,
    /// log, tanh, sigmoid are not linear.
    Unary { linear: bool },
    /// `a op b` with numpy broadcasting.
    Binary(BinaryOp),
    /// Reduce `dims` (sorted, distinct, non-empty); `keepdim` keeps them as size 1.
    Reduce {
        kind: ReduceKind,
        dims: Dims,
        keepdim: bool,
    },
    /// Sum the input down to `shape`, which broadcasts to the input shape (the gradient of a
    /// broadcast): leading extra dims and dims where `shape` has 1 are summed.
    ReduceToShape { shape: Shape },
    /// Broadcast the input to `shape` (numpy rules).
    BroadcastTo { shape: Shape },
    /// Softmax over `dim`.
    Softmax { dim: usize },
    /// Log-softmax over `dim`.
    LogSoftmax { dim: usize },
    /// Inputs `(y, dy)` where y = softmax(x); output dx = y * (dy - sum(dy * y, dim)).
    SoftmaxBackward { dim: usize },
    /// Inputs `(y, dy)` where y = log_softmax(x); output dx = dy - exp(y) * sum(dy, dim).
    LogSoftmaxBackward { dim: usize },
    /// Output dim i is input dim `perm[i]` (transpose is a permute).
    Permute { perm: Dims },
    /// Row-major reshape to `shape` (same element count).
    Reshape { shape: Shape },
    /// Concatenate n >= 1 inputs along `dim`; other dims equal.
    Concat { dim: usize },
    /// Keep `start..end` of `dim` (narrow).
    Slice {
        dim: usize,
        start: usize,
        end: usize,
    },
    /// Inputs `(ids [..], weight [V, D])` -> `[.., D]`; ids are integers in `0..V`.
    Embedding,
    /// Inputs `(ids [..], dy [.., D])` -> weight gradient `[num_embeddings, D]` (scatter-add);
    /// `vocab_split`: the weight is split on the vocabulary, so a split gradient comes first.
    EmbeddingBackward {
        num_embeddings: usize,
        vocab_split: bool,
    },
    /// Inputs `(x, weight, bias)`: normalise over the last `normalized_dims` dims of x, whose
    /// shape weight and bias have; outputs y with x's shape and the per-row mean and 1/std
    /// (x's shape with the normalised dims 1).
    LayerNorm { normalized_dims: usize },
    /// Inputs `(x, weight, dy, mean, rstd)` -> dx.
    LayerNormBackward { normalized_dims: usize },
    /// Inputs `(logits [N, C], labels [N])` -> the per-sample loss `[N]`
    /// (`logsumexp(logits[i]) - logits[i, labels[i]]`, no reduction: the mean loss is a
    /// following `Reduce { Mean }`, so each piece stays an ordinary op).
    CrossEntropy,
    /// Inputs `(logits [N, C], labels [N], dloss [N])` -> `dlogits [N, C]`
    /// (`(softmax(logits) - onehot(labels)) * dloss`).
    CrossEntropyBackward,
    /// Inputs `(x, index)` (index with x's shape but on `dim`) -> index's shape: torch.gather.
    Gather { dim: usize },
    /// Inputs `(index, src)` of one shape -> that shape with `dim` of `size`: src added at index.
    /// `split_first`: a split output is preferred (the gathered data was split on `dim`).
    ScatterAdd {
        dim: usize,
        size: usize,
        split_first: bool,
    },
    /// Inputs `(x, ids [n])` -> x's shape with `dim` of size n: the slices at ids.
    IndexSelect { dim: usize },
    /// Inputs `(ids [n], src)` -> src's shape with `dim` of `size`: slices added at ids.
    IndexAdd {
        dim: usize,
        size: usize,
        split_first: bool,
    },
}

impl OpKind {
    /// Short name used in error messages.
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::MatMul => "matmul",
            OpKind::BatchMatMul => "batch_matmul",
            OpKind::Unary { linear: true } => "unary(linear)",
            OpKind::Unary { linear: false } => "unary",
            OpKind::Binary(BinaryOp::Add) => "add",
            OpKind::Binary(BinaryOp::Sub) => "sub",
            OpKind::Binary(BinaryOp::Mul) => "mul",
            OpKind::Binary(BinaryOp::Div) => "div",
            OpKind::Reduce {
                kind: ReduceKind::Sum,
                ..
            } => "sum",
            OpKind::Reduce {
                kind: ReduceKind::Mean,
                ..
            } => "mean",
            OpKind::Reduce {
                kind: ReduceKind::Max,
                ..
            } => "max",
            OpKind::Reduce {
                kind: ReduceKind::Min,
                ..
            } => "min",
            OpKind::ReduceToShape { .. } => "reduce_to_shape",
            OpKind::BroadcastTo { .. } => "broadcast_to",
            OpKind::Softmax { .. } => "softmax",
            OpKind::LogSoftmax { .. } => "log_softmax",
            OpKind::SoftmaxBackward { .. } => "softmax_backward",
            OpKind::LogSoftmaxBackward { .. } => "log_softmax_backward",
            OpKind::Permute { .. } => "permute",
            OpKind::Reshape { .. } => "reshape",
            OpKind::Concat { .. } => "concat",
            OpKind::Slice { .. } => "slice",
            OpKind::Embedding => "embedding",
            OpKind::EmbeddingBackward { .. } => "embedding_backward",
            OpKind::LayerNorm { .. } => "layer_norm",
            OpKind::LayerNormBackward { .. } => "layer_norm_backward",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::CrossEntropyBackward => "cross_entropy_backward",
            OpKind::Gather { .. } => "gather",
            OpKind::ScatterAdd { .. } => "scatter_add",
            OpKind::IndexSelect { .. } => "index_select",
            OpKind::IndexAdd { .. } => "index_add",
        }
    }

    /// The number of inputs the op takes (None: any number >= 1, for concat).
    pub fn num_inputs(&self) -> Option<usize> {
        match self {
            OpKind::Unary { .. }
            | OpKind::Reduce { .. }
            | OpKind::ReduceToShape { .. }
            | OpKind::BroadcastTo { .. }
            | OpKind::Softmax { .. }
            | OpKind::LogSoftmax { .. }
            | OpKind::Permute { .. }
            | OpKind::Reshape { .. }
            | OpKind::Slice { .. } => Some(1),
            OpKind::MatMul
            | OpKind::BatchMatMul
            | OpKind::Binary(_)
            | OpKind::SoftmaxBackward { .. }
            | OpKind::LogSoftmaxBackward { .. }
            | OpKind::Embedding
            | OpKind::EmbeddingBackward { .. }
            | OpKind::CrossEntropy
            | OpKind::Gather { .. }
            | OpKind::ScatterAdd { .. }
            | OpKind::IndexSelect { .. }
            | OpKind::IndexAdd { .. } => Some(2),
            OpKind::LayerNorm { .. } | OpKind::CrossEntropyBackward => Some(3),
            OpKind::LayerNormBackward { .. } => Some(5),
            OpKind::Concat { .. } => None,
        }
    }
}

impl fmt::Display for OpKind {
    /// The name plus attributes, e.g. `sum(dims=[1], keepdim=false)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        match self {
            OpKind::Reduce { dims, keepdim, .. } => {
                write!(f, "{name}(dims={:?}, keepdim={keepdim})", dims.as_slice())
            }
            OpKind::ReduceToShape { shape }
            | OpKind::BroadcastTo { shape }
            | OpKind::Reshape { shape } => {
                write!(f, "{name}({shape})")
            }
            OpKind::Softmax { dim }
            | OpKind::LogSoftmax { dim }
            | OpKind::SoftmaxBackward { dim }
            | OpKind::LogSoftmaxBackward { dim }
            | OpKind::Concat { dim }
            | OpKind::Gather { dim }
            | OpKind::IndexSelect { dim } => write!(f, "{name}(dim={dim})"),
            OpKind::ScatterAdd {
                dim,
                size,
                split_first,
            }
            | OpKind::IndexAdd {
                dim,
                size,
                split_first,
            } => write!(
                f,
                "{name}(dim={dim}, size={size}, split_first={split_first})"
            ),
            OpKind::Permute { perm } => write!(f, "{name}({:?})", perm.as_slice()),
            OpKind::Slice { dim, start, end } => write!(f, "{name}(dim={dim}, {start}..{end})"),
            OpKind::EmbeddingBackward {
                num_embeddings,
                vocab_split,
            } => write!(
                f,
                "{name}(num_embeddings={num_embeddings}, vocab_split={vocab_split})"
            ),
            OpKind::LayerNorm { normalized_dims }
            | OpKind::LayerNormBackward { normalized_dims } => {
                write!(f, "{name}(normalized_dims={normalized_dims})")
            }
            _ => f.write_str(name),
        }
    }
}
