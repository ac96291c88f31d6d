//! Signature inference: per-op candidate tables (one rule builder per op, one file per op
//! family), their n-d product over the mesh axes, and the engine that picks the cheapest
//! candidate. The ops themselves (the one catalogue) are the tensor crate's families, which
//! call these builders; callers cache their choices (the tensor crate's dispatch plans).
//!
//! Each op family gives the output shapes and its *per-axis* candidates (the SBP of every input
//! and output on one mesh axis). An n-d candidate is one per-axis candidate per mesh axis; the
//! product is taken in lexicographic order, mesh axis 0 outermost, so candidate order (and so
//! every tie-break) is the same on every rank.

mod attention;
mod candidates;
mod concat;
mod elementwise;
mod embedding;
mod engine;
mod experts;
mod gather;
mod linear;
mod loss;
mod matmul;
mod norm;
mod permute;
mod reduce;
mod reshape;
mod select;
mod softmax;

use smallvec::SmallVec;

use crate::{ReduceOp, Sbp, Shape};

pub use elementwise::BinaryOp;
pub use engine::{InferEngine, Signature};
pub use reduce::ReduceKind;

/// The rule builders, one function per op (grouped by family): each checks the input shapes and
/// returns the output shapes with the op's SBP candidates.
pub mod rules {
    pub use super::attention::{
        attention_candidates, attention_probs, decode_attention, decode_attention_parts,
        fused_attention, fused_attention_backward, rotary_at, rotary_qkv_at, rotary_tables,
        HEAD_LAYOUTS, SEQUENCE_LAYOUTS,
    };
    pub use super::concat::{concat, slice, write_rows};
    pub use super::elementwise::{
        binary, broadcast_shape, broadcast_to, pointwise, reduce_to_shape, swiglu_pairs, unary,
        whole,
    };
    pub use super::embedding::{backward as embedding_backward, forward as embedding};
    pub use super::experts::{
        expert_matmul, expert_matmul_wgrad, routed_experts, routed_experts_backward, router_topk,
    };
    pub use super::gather::{gather, index_add, index_select, scatter_add};
    pub use super::linear::{
        linear, linear_classifier, linear_classifier_backward, linear_weight_grad, residual_mlp,
        residual_mlp_backward,
    };
    pub use super::loss::{
        backward as cross_entropy_backward, classifier, classifier_backward,
        forward as cross_entropy, vocab_parallel, vocab_parallel_lse,
    };
    pub use super::matmul::{batch_matmul, matmul, matmul_t};
    pub use super::norm::{
        backward as layer_norm_backward, forward as layer_norm, residual_layer_norm,
        residual_layer_norm_backward, rms_norm, rms_norm_backward, stats_shape as layer_norm_stats,
    };
    pub use super::permute::permute;
    pub use super::reduce::{arg_reduce, reduce, sum_squares};
    pub use super::reshape::reshape;
    pub use super::select::{masked_fill, positional, where_cond};
    pub use super::softmax::{backward as softmax_backward, forward as softmax};
    pub use super::{RuleMode, Rules};
}

/// SBPs of the inputs (or outputs) of one op.
pub(crate) type SbpList = SmallVec<[Sbp; 3]>;

/// One per-axis candidate: the SBP of each input and of each output on one mesh axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AxisCand {
    pub ins: SbpList,
    pub outs: SbpList,
}

/// What a rule builder produces: output shapes alone (for ops on local tensors, which need no
/// candidates), or output shapes and SBP candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuleMode {
    ShapesOnly,
    Candidates,
}

/// What an op's rule builder says about one call: output shapes and, in
/// `RuleMode::Candidates`, its per-axis candidates in order. Built by the functions of
/// [`rules`](crate::rules) (one per op family), read by [`InferEngine::choose`].
#[derive(Clone, Debug)]
pub struct Rules {
    out_shapes: SmallVec<[Shape; 1]>,
    pub(crate) axis: Vec<AxisCand>,
    mode: RuleMode,
    /// A reshape's input shape: its n-d candidates need the nested-split check of `reshape`.
    pub(crate) reshape_from: Option<Shape>,
    /// (input, dim, groups): an n-d candidate splitting that input's dim must split it into
    /// whole groups, `groups` dividing evenly over the ranks of the splitting axes (grouped-
    /// query attention: each rank's query heads then meet their own key/value heads).
    pub(crate) even_split: Option<(usize, usize, usize)>,
}

/// The three partial reductions, in candidate order.
pub(crate) const PARTIALS: [Sbp; 3] = [
    Sbp::Partial(ReduceOp::Sum),
    Sbp::Partial(ReduceOp::Max),
    Sbp::Partial(ReduceOp::Min),
];

impl Rules {
    pub fn new(mode: RuleMode, out_shapes: impl IntoIterator<Item = Shape>) -> Self {
        Rules {
            out_shapes: out_shapes.into_iter().collect(),
            axis: Vec::new(),
            mode,
            reshape_from: None,
            even_split: None,
        }
    }
    /// Keeps only the n-d candidates that split input `input`'s dim `dim` (of `groups` whole
    /// groups) evenly: the product of the sizes of the mesh axes splitting it divides `groups`.
    pub fn with_even_split(mut self, input: usize, dim: usize, groups: usize) -> Self {
        self.even_split = Some((input, dim, groups));
        self
    }
    /// The output shapes (one per output).
    pub fn out_shapes(&self) -> &[Shape] {
        &self.out_shapes
    }
    /// Output `i`'s shape, moved out.
    pub fn into_out_shape(mut self, i: usize) -> Option<Shape> {
        (i < self.out_shapes.len()).then(|| self.out_shapes.swap_remove(i))
    }
    /// Appends a per-axis candidate unless it is already listed (nothing in `ShapesOnly`).
    pub fn push(&mut self, ins: &[Sbp], outs: &[Sbp]) {
        if self.mode == RuleMode::ShapesOnly {
            return;
        }
        let c = AxisCand {
            ins: ins.iter().copied().collect(),
            outs: outs.iter().copied().collect(),
        };
        if !self.axis.contains(&c) {
            self.axis.push(c);
        }
    }
    /// Appends the same SBP on every input and every output.
    pub fn push_uniform(&mut self, n_in: usize, n_out: usize, sbp: Sbp) {
        let ins: SbpList = std::iter::repeat_n(sbp, n_in).collect();
        let outs: SbpList = std::iter::repeat_n(sbp, n_out).collect();
        self.push(&ins, &outs);
    }
    /// These candidates with one more input, an accumulator added to output `out` (`y =
    /// f(..) + acc`) taking that output's SBP in each: a split or broadcast output adds its
    /// own piece, a partial sum each rank's part. Candidates whose output is a partial max or
    /// min, which a sum does not pass through, are dropped.
    pub fn with_accumulator(mut self, out: usize) -> Self {
        self.axis.retain(|c| {
            !matches!(
                c.outs.get(out),
                Some(Sbp::Partial(ReduceOp::Max | ReduceOp::Min)) | None
            )
        });
        for c in &mut self.axis {
            let s = c.outs[out];
            c.ins.push(s);
        }
        self
    }
    /// Appends all-B, which every op accepts, as the last candidate.
    pub(crate) fn push_all_broadcast(&mut self, n_in: usize) {
        let n_out = self.out_shapes.len();
        self.push_uniform(n_in, n_out, Sbp::Broadcast);
    }
}
