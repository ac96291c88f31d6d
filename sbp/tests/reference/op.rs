//! The tests' description of op calls (`RuleCall`: which rule builder of `oxiflow_sbp::rules`,
//! with what attributes) and signature inference through it: the rule builder's candidates
//! handed to `InferEngine::choose` / `InferEngine::candidates`, rule errors reported as the
//! tensor layer reports them (`SbpError::Op` naming op, shapes, nd-SBPs and placement).

use std::fmt;

use oxiflow_placement::Placement;
use oxiflow_sbp::{
    rules, BinaryOp, InferEngine, NdSbp, ReduceKind, RuleMode, Rules, SbpError, Shape, Signature,
};
use smallvec::SmallVec;

/// A list of tensor dims (reduce dims, permutations).
pub type Dims = SmallVec<[usize; 6]>;

/// One call of a rule builder of `oxiflow_sbp::rules` with the attributes it takes: the tests'
/// description of ops, over the same builders the tensor crate's families call. Dims are
/// non-negative. Inputs of every op are listed in the doc of its variant; every op has one
/// output unless said otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RuleCall {
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

impl RuleCall {
    /// Short name used in error messages.
    pub fn name(&self) -> &'static str {
        match self {
            RuleCall::MatMul => "matmul",
            RuleCall::BatchMatMul => "batch_matmul",
            RuleCall::Unary { linear: true } => "unary(linear)",
            RuleCall::Unary { linear: false } => "unary",
            RuleCall::Binary(BinaryOp::Add) => "add",
            RuleCall::Binary(BinaryOp::Sub) => "sub",
            RuleCall::Binary(BinaryOp::Mul) => "mul",
            RuleCall::Binary(BinaryOp::Div) => "div",
            RuleCall::Reduce {
                kind: ReduceKind::Sum,
                ..
            } => "sum",
            RuleCall::Reduce {
                kind: ReduceKind::Mean,
                ..
            } => "mean",
            RuleCall::Reduce {
                kind: ReduceKind::Max,
                ..
            } => "max",
            RuleCall::Reduce {
                kind: ReduceKind::Min,
                ..
            } => "min",
            RuleCall::ReduceToShape { .. } => "reduce_to_shape",
            RuleCall::BroadcastTo { .. } => "broadcast_to",
            RuleCall::Softmax { .. } => "softmax",
            RuleCall::LogSoftmax { .. } => "log_softmax",
            RuleCall::SoftmaxBackward { .. } => "softmax_backward",
            RuleCall::LogSoftmaxBackward { .. } => "log_softmax_backward",
            RuleCall::Permute { .. } => "permute",
            RuleCall::Reshape { .. } => "reshape",
            RuleCall::Concat { .. } => "concat",
            RuleCall::Slice { .. } => "slice",
            RuleCall::Embedding => "embedding",
            RuleCall::EmbeddingBackward { .. } => "embedding_backward",
            RuleCall::LayerNorm { .. } => "layer_norm",
            RuleCall::LayerNormBackward { .. } => "layer_norm_backward",
            RuleCall::CrossEntropy => "cross_entropy",
            RuleCall::CrossEntropyBackward => "cross_entropy_backward",
            RuleCall::Gather { .. } => "gather",
            RuleCall::ScatterAdd { .. } => "scatter_add",
            RuleCall::IndexSelect { .. } => "index_select",
            RuleCall::IndexAdd { .. } => "index_add",
        }
    }

    /// The number of inputs the op takes (None: any number >= 1, for concat).
    pub fn num_inputs(&self) -> Option<usize> {
        match self {
            RuleCall::Unary { .. }
            | RuleCall::Reduce { .. }
            | RuleCall::ReduceToShape { .. }
            | RuleCall::BroadcastTo { .. }
            | RuleCall::Softmax { .. }
            | RuleCall::LogSoftmax { .. }
            | RuleCall::Permute { .. }
            | RuleCall::Reshape { .. }
            | RuleCall::Slice { .. } => Some(1),
            RuleCall::MatMul
            | RuleCall::BatchMatMul
            | RuleCall::Binary(_)
            | RuleCall::SoftmaxBackward { .. }
            | RuleCall::LogSoftmaxBackward { .. }
            | RuleCall::Embedding
            | RuleCall::EmbeddingBackward { .. }
            | RuleCall::CrossEntropy
            | RuleCall::Gather { .. }
            | RuleCall::ScatterAdd { .. }
            | RuleCall::IndexSelect { .. }
            | RuleCall::IndexAdd { .. } => Some(2),
            RuleCall::LayerNorm { .. } | RuleCall::CrossEntropyBackward => Some(3),
            RuleCall::LayerNormBackward { .. } => Some(5),
            RuleCall::Concat { .. } => None,
        }
    }
}

impl fmt::Display for RuleCall {
    /// The name plus attributes, e.g. `sum(dims=[1], keepdim=false)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        match self {
            RuleCall::Reduce { dims, keepdim, .. } => {
                write!(f, "{name}(dims={:?}, keepdim={keepdim})", dims.as_slice())
            }
            RuleCall::ReduceToShape { shape }
            | RuleCall::BroadcastTo { shape }
            | RuleCall::Reshape { shape } => {
                write!(f, "{name}({shape})")
            }
            RuleCall::Softmax { dim }
            | RuleCall::LogSoftmax { dim }
            | RuleCall::SoftmaxBackward { dim }
            | RuleCall::LogSoftmaxBackward { dim }
            | RuleCall::Concat { dim }
            | RuleCall::Gather { dim }
            | RuleCall::IndexSelect { dim } => write!(f, "{name}(dim={dim})"),
            RuleCall::ScatterAdd {
                dim,
                size,
                split_first,
            }
            | RuleCall::IndexAdd {
                dim,
                size,
                split_first,
            } => write!(
                f,
                "{name}(dim={dim}, size={size}, split_first={split_first})"
            ),
            RuleCall::Permute { perm } => write!(f, "{name}({:?})", perm.as_slice()),
            RuleCall::Slice { dim, start, end } => write!(f, "{name}(dim={dim}, {start}..{end})"),
            RuleCall::EmbeddingBackward {
                num_embeddings,
                vocab_split,
            } => write!(
                f,
                "{name}(num_embeddings={num_embeddings}, vocab_split={vocab_split})"
            ),
            RuleCall::LayerNorm { normalized_dims }
            | RuleCall::LayerNormBackward { normalized_dims } => {
                write!(f, "{name}(normalized_dims={normalized_dims})")
            }
            _ => f.write_str(name),
        }
    }
}

impl RuleCall {
    /// Output shapes and per-axis candidates for these input shapes from the op's rule
    /// builder, or the builder's detail message saying what is wrong with them.
    pub fn rules(&self, shapes: &[&Shape]) -> Result<Rules, String> {
        let op = self;
        if let Some(n) = op.num_inputs() {
            if shapes.len() != n {
                return Err(format!("takes {n} inputs, got {}", shapes.len()));
            }
        } else if shapes.is_empty() {
            return Err("takes at least one input, got none".into());
        }
        let m = RuleMode::Candidates;
        Ok(match op {
            RuleCall::MatMul => rules::matmul(shapes[0], shapes[1], m)?,
            RuleCall::BatchMatMul => rules::batch_matmul(shapes[0], shapes[1], m)?,
            RuleCall::Unary { linear } => rules::unary(shapes[0], *linear, m),
            RuleCall::Binary(b) => rules::binary(*b, shapes[0], shapes[1], m)?,
            RuleCall::BroadcastTo { shape } => rules::broadcast_to(shapes[0], shape, m)?,
            RuleCall::ReduceToShape { shape } => rules::reduce_to_shape(shapes[0], shape, m)?,
            RuleCall::Reduce {
                kind,
                dims,
                keepdim,
            } => rules::reduce(*kind, dims, *keepdim, shapes[0], m)?,
            RuleCall::Softmax { dim } | RuleCall::LogSoftmax { dim } => {
                rules::softmax(*dim, shapes[0], m)?
            }
            RuleCall::SoftmaxBackward { dim } | RuleCall::LogSoftmaxBackward { dim } => {
                rules::softmax_backward(*dim, shapes[0], shapes[1], m)?
            }
            RuleCall::Permute { perm } => rules::permute(perm, shapes[0], m)?,
            RuleCall::Reshape { shape } => rules::reshape(shapes[0], shape, m)?,
            RuleCall::Concat { dim } => rules::concat(*dim, shapes, m)?,
            RuleCall::Slice { dim, start, end } => rules::slice(*dim, *start, *end, shapes[0], m)?,
            RuleCall::Embedding => rules::embedding(shapes[0], shapes[1], m)?,
            RuleCall::EmbeddingBackward {
                num_embeddings,
                vocab_split,
            } => rules::embedding_backward(*num_embeddings, shapes[0], shapes[1], *vocab_split, m)?,
            RuleCall::LayerNorm { normalized_dims } => {
                rules::layer_norm(*normalized_dims, shapes, m)?
            }
            RuleCall::LayerNormBackward { normalized_dims } => {
                rules::layer_norm_backward(*normalized_dims, shapes, m)?
            }
            RuleCall::CrossEntropy => rules::cross_entropy(shapes[0], shapes[1], m)?,
            RuleCall::CrossEntropyBackward => rules::cross_entropy_backward(shapes, m)?,
            RuleCall::Gather { dim } => rules::gather(*dim, shapes[0], shapes[1], m)?,
            RuleCall::IndexSelect { dim } => rules::index_select(*dim, shapes[0], shapes[1], m)?,
            RuleCall::ScatterAdd {
                dim,
                size,
                split_first,
            } => rules::scatter_add(*dim, *size, shapes[0], shapes[1], *split_first, m)?,
            RuleCall::IndexAdd {
                dim,
                size,
                split_first,
            } => rules::index_add(*dim, *size, shapes[0], shapes[1], *split_first, m)?,
        })
    }
}

fn shape_list(shapes: &[&Shape]) -> String {
    let v: Vec<String> = shapes.iter().map(|s| s.to_string()).collect();
    v.join(", ")
}

fn rule_error(
    op: &RuleCall,
    shapes: &[&Shape],
    inputs: Option<&[(&Shape, &NdSbp)]>,
    placement: &Placement,
    detail: String,
) -> SbpError {
    let sbps = match inputs {
        Some(inputs) => {
            let v: Vec<String> = inputs.iter().map(|(_, n)| n.to_string()).collect();
            v.join(", ")
        }
        None => "-".into(),
    };
    SbpError::Op {
        op: op.to_string(),
        detail,
        shapes: shape_list(shapes),
        sbps,
        placement: placement.to_string(),
    }
}

/// The signature `InferEngine::choose` picks for `op` on `inputs` (shape and current nd-SBP of
/// each) over `placement`.
pub fn infer(
    op: &RuleCall,
    inputs: &[(&Shape, &NdSbp)],
    placement: &Placement,
    elem_size: usize,
) -> Result<Signature, SbpError> {
    let shapes: Vec<&Shape> = inputs.iter().map(|(s, _)| *s).collect();
    let r = op
        .rules(&shapes)
        .map_err(|d| rule_error(op, &shapes, Some(inputs), placement, d))?;
    InferEngine::choose(&op.to_string(), r, inputs, placement, elem_size)
}

/// Every n-d candidate of `op` for these input shapes over `placement`, in the engine's order.
pub fn candidates(
    op: &RuleCall,
    shapes: &[&Shape],
    placement: &Placement,
) -> Result<Vec<Signature>, SbpError> {
    let r = op
        .rules(shapes)
        .map_err(|d| rule_error(op, shapes, None, placement, d))?;
    Ok(InferEngine::candidates(r, shapes.len(), placement))
}
