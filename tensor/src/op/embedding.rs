//! Embedding lookup (rows of a weight at integer ids) and its weight gradient (scatter-add).
//! The weight may be split on the vocabulary (S(0)): each rank looks up the ids inside its
//! rows and gives zero rows for the others (a partial sum), and the gradient of a split weight
//! comes out split the same way.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, NdSbp, RuleMode, Sbp, Shape};

use super::gather::{split_on, Along, GatherKernels, IndexShard};
use super::grad::Grad;
use super::{
    need_float, need_i64, shape_rule, single, Inferred, LocalAt, MetaResult, OpFamily, RunKernels,
    Saves,
};
use crate::tensor::{Tensor, TensorMeta};
use crate::Result;

/// The embedding family. Inputs: (ids [..] i64, weight [V, H]) and (ids [..], dy [.., H]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EmbeddingOp {
    /// -> [.., H]; `shard`: the weight rows this rank holds (set by `local`).
    Lookup { shard: IndexShard },
    /// -> dweight [num, H]; `vocab_split`: the weight is split on the vocabulary, so a split
    /// gradient is preferred; `shard`: the dweight rows this rank holds (set by `local`).
    Backward {
        num: usize,
        vocab_split: bool,
        shard: IndexShard,
    },
}

/// Embedding kernels of a backend: the gather kernels' read and scatter-add along dim 0 of the
/// weight at one id per position (ids outside `0..shard.total` are a typed error; ids of other
/// ranks' rows give zero rows, or are skipped by the backward).
pub trait EmbeddingKernels: GatherKernels {}
impl<T: GatherKernels> EmbeddingKernels for T {}

impl OpFamily for EmbeddingOp {
    fn name(&self) -> &'static str {
        match self {
            EmbeddingOp::Lookup { .. } => "embedding",
            EmbeddingOp::Backward { .. } => "embedding_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (2, 2)
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        need_i64(d[0], "ids")?;
        match self {
            EmbeddingOp::Lookup { .. } => {
                need_float(d[1], "weight")?;
                Ok(Inferred::new(
                    shape_rule(rules::embedding(s[0], s[1], mode))?,
                    d[1],
                ))
            }
            EmbeddingOp::Backward {
                num, vocab_split, ..
            } => {
                need_float(d[1], "dy")?;
                Ok(Inferred::new(
                    shape_rule(rules::embedding_backward(
                        *num,
                        s[0],
                        s[1],
                        *vocab_split,
                        mode,
                    ))?,
                    d[1],
                ))
            }
        }
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        Some(match self {
            EmbeddingOp::Backward { vocab_split, .. } => EmbeddingOp::Backward {
                num: at.out_local.dim(0),
                vocab_split: *vocab_split,
                shard: IndexShard::of_output(at, 0),
            },
            EmbeddingOp::Lookup { .. } => EmbeddingOp::Lookup {
                shard: IndexShard::of_input(at, 1, 0),
            },
        })
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            EmbeddingOp::Lookup { .. } => Saves::inputs(&[0]),
            EmbeddingOp::Backward { .. } => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        match self {
            EmbeddingOp::Lookup { .. } => {
                let w = g.input_meta(1);
                let op = EmbeddingOp::Backward {
                    num: w.shape().dim(0),
                    vocab_split: split_on(w.nd_sbp(), 0),
                    shard: IndexShard::default(),
                };
                Ok(vec![
                    None,
                    g.when(1, || {
                        let dy = broadcast_where_vocab_split(g.dy()?, w)?;
                        let dw = Tensor::apply(op, &[g.input(0)?, &dy])?;
                        unsplit_where_weight_whole(dw, w)
                    })?,
                ])
            }
            EmbeddingOp::Backward { .. } => Err(Grad::higher_order(self.name())),
        }
    }
}

impl<B: EmbeddingKernels> RunKernels<B> for EmbeddingOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let (op, y) = (self.name(), single(self.name(), out)?);
        match *self {
            EmbeddingOp::Lookup { shard } => {
                b.take(op, x[1], x[0], Along::per_position(0, shard), y)
            }
            EmbeddingOp::Backward { shard, .. } => {
                b.put(op, x[0], x[1], Along::per_position(0, shard), y)
            }
        }
    }
}

/// `dy` made B on the mesh axes where the weight `w` is split on the vocabulary (a reduction
/// of `[.., H]` when it is partial there), so the gradient comes out in the weight's split
/// without moving dweight.
fn broadcast_where_vocab_split(dy: &Tensor, w: &TensorMeta) -> Result<Tensor> {
    let (Some(p), Some(ws), Some(ds)) = (w.placement(), w.nd_sbp(), dy.nd_sbp()) else {
        return Ok(dy.clone());
    };
    let target = NdSbp::new(
        ws.iter()
            .zip(ds.iter())
            .map(|(a, d)| if a == Sbp::S(0) { Sbp::B } else { d }),
    );
    if &target == ds {
        return Ok(dy.clone());
    }
    dy.to_global(p, target)
}

/// `dw` with its vocabulary split (S(0)) undone on the mesh axes where the weight `w` is not
/// split that way: with ids and dy B on such an axis the split and the whole gradient tie in
/// signature inference, and the split one is listed first for the axes that need it.
fn unsplit_where_weight_whole(dw: Tensor, w: &TensorMeta) -> Result<Tensor> {
    let (Some(p), Some(ws), Some(gs)) = (w.placement(), w.nd_sbp(), dw.nd_sbp()) else {
        return Ok(dw);
    };
    let target = NdSbp::new(ws.iter().zip(gs.iter()).map(|(a, g)| {
        if g == Sbp::S(0) && a != Sbp::S(0) {
            a
        } else {
            g
        }
    }));
    if &target == gs {
        return Ok(dw);
    }
    dw.to_global(p, target)
}
