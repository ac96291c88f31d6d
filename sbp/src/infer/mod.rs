//! Signature inference: per-op candidate tables (one file per op family), their n-d product
//! over the mesh axes, and the cached engine that picks the cheapest candidate.
//!
//! Each op family gives the output shapes and its *per-axis* candidates (the SBP of every input
//! and output on one mesh axis). An n-d candidate is one per-axis candidate per mesh axis; the
//! product is taken in lexicographic order, mesh axis 0 outermost, so candidate order (and so
//! every tie-break) is the same on every rank.

mod concat;
mod elementwise;
mod embedding;
mod engine;
mod loss;
mod matmul;
mod norm;
mod op;
mod permute;
mod reduce;
mod reshape;
mod softmax;

use oxiflow_placement::Placement;
use smallvec::SmallVec;

use crate::{NdSbp, ReduceOp, Sbp, Shape};

pub use engine::{InferEngine, Signature, SignatureCache};
pub use op::{BinaryOp, Dims, OpKind, ReduceKind};

/// SBPs of the inputs (or outputs) of one op.
pub(crate) type SbpList = SmallVec<[Sbp; 3]>;

/// One per-axis candidate: the SBP of each input and of each output on one mesh axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AxisCand {
    pub ins: SbpList,
    pub outs: SbpList,
}

/// What an op family says about one call: output shapes and per-axis candidates in order.
pub(crate) struct Rules {
    pub out_shapes: Vec<Shape>,
    pub axis: Vec<AxisCand>,
}

/// The three partial reductions, in candidate order.
pub(crate) const PARTIALS: [Sbp; 3] = [
    Sbp::Partial(ReduceOp::Sum),
    Sbp::Partial(ReduceOp::Max),
    Sbp::Partial(ReduceOp::Min),
];

impl Rules {
    pub fn new(out_shapes: Vec<Shape>) -> Self {
        Rules {
            out_shapes,
            axis: Vec::new(),
        }
    }
    /// Appends a per-axis candidate unless it is already listed.
    pub fn push(&mut self, ins: &[Sbp], outs: &[Sbp]) {
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
}

/// Output shapes and per-axis candidates of `op` for these input shapes, or a detail message
/// saying what is wrong with them (the engine adds op, shapes and SBPs).
pub(crate) fn rules(op: &OpKind, shapes: &[&Shape]) -> Result<Rules, String> {
    if let Some(n) = op.num_inputs() {
        if shapes.len() != n {
            return Err(format!("takes {n} inputs, got {}", shapes.len()));
        }
    } else if shapes.is_empty() {
        return Err("takes at least one input, got none".into());
    }
    let mut r = match op {
        OpKind::MatMul => matmul::matmul(shapes[0], shapes[1])?,
        OpKind::BatchMatMul => matmul::batch_matmul(shapes[0], shapes[1])?,
        OpKind::Unary { linear } => elementwise::unary(shapes[0], *linear),
        OpKind::Binary(b) => elementwise::binary(*b, shapes[0], shapes[1])?,
        OpKind::BroadcastTo { shape } => elementwise::broadcast_to(shapes[0], shape)?,
        OpKind::ReduceToShape { shape } => elementwise::reduce_to_shape(shapes[0], shape)?,
        OpKind::Reduce {
            kind,
            dims,
            keepdim,
        } => reduce::reduce(*kind, dims, *keepdim, shapes[0])?,
        OpKind::Softmax { dim } | OpKind::LogSoftmax { dim } => softmax::forward(*dim, shapes[0])?,
        OpKind::SoftmaxBackward { dim } | OpKind::LogSoftmaxBackward { dim } => {
            softmax::backward(*dim, shapes[0], shapes[1])?
        }
        OpKind::Permute { perm } => permute::permute(perm, shapes[0])?,
        OpKind::Reshape { shape } => reshape::reshape(shapes[0], shape)?,
        OpKind::Concat { dim } => concat::concat(*dim, shapes)?,
        OpKind::Slice { dim, start, end } => concat::slice(*dim, *start, *end, shapes[0])?,
        OpKind::Embedding => embedding::forward(shapes[0], shapes[1])?,
        OpKind::EmbeddingBackward { num_embeddings } => {
            embedding::backward(*num_embeddings, shapes[0], shapes[1])?
        }
        OpKind::LayerNorm { normalized_dims } => norm::forward(*normalized_dims, shapes)?,
        OpKind::LayerNormBackward { normalized_dims } => norm::backward(*normalized_dims, shapes)?,
        OpKind::CrossEntropy => loss::forward(shapes[0], shapes[1])?,
        OpKind::CrossEntropyBackward => loss::backward(shapes)?,
    };
    // All-B is always a candidate.
    let n_out = r.out_shapes.len();
    r.push_uniform(shapes.len(), n_out, Sbp::Broadcast);
    Ok(r)
}

/// Whether an n-d candidate (one per-axis candidate index per mesh axis) is valid beyond what
/// the per-axis tables say. Only reshape depends on the sizes each nested split sees.
pub(crate) fn nd_ok(
    op: &OpKind,
    shapes: &[&Shape],
    rules: &Rules,
    placement: &Placement,
    ins: &[NdSbp],
    outs: &[NdSbp],
) -> bool {
    match op {
        OpKind::Reshape { .. } => reshape::nd_ok(
            shapes[0],
            &rules.out_shapes[0],
            placement,
            &ins[0],
            &outs[0],
        ),
        _ => true,
    }
}

/// Visits all n-d candidates in order: the product of the per-axis candidates over the mesh
/// axes, axis 0 outermost (the last axis varies fastest), filtered by `nd_ok`. `visit` gets the
/// input and output nd-SBPs of each, in buffers reused between calls (no allocation per
/// candidate).
pub(crate) fn for_each_nd(
    op: &OpKind,
    shapes: &[&Shape],
    rules: &Rules,
    placement: &Placement,
    mut visit: impl FnMut(&[NdSbp], &[NdSbp]),
) {
    let axes = placement.ndim();
    let k = rules.axis.len();
    if k == 0 {
        return;
    }
    let first = &rules.axis[0];
    let mut ins: SmallVec<[NdSbp; 3]> =
        first.ins.iter().map(|&s| NdSbp::uniform(s, axes)).collect();
    let mut outs: SmallVec<[NdSbp; 3]> = first
        .outs
        .iter()
        .map(|&s| NdSbp::uniform(s, axes))
        .collect();
    let mut idx: SmallVec<[usize; 4]> = SmallVec::from_elem(0, axes);
    loop {
        if nd_ok(op, shapes, rules, placement, &ins, &outs) {
            visit(&ins, &outs);
        }
        // Next index, last axis fastest; refresh the axes that changed.
        let mut a = axes;
        loop {
            if a == 0 {
                return;
            }
            a -= 1;
            idx[a] = (idx[a] + 1) % k;
            let c = &rules.axis[idx[a]];
            for (nd, &s) in ins.iter_mut().zip(&c.ins) {
                nd.set(a, s);
            }
            for (nd, &s) in outs.iter_mut().zip(&c.outs) {
                nd.set(a, s);
            }
            if idx[a] != 0 {
                break;
            }
        }
    }
}
