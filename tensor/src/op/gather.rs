//! Indexed reads along one dim and their gradients: `gather` (torch.gather), `index_select`,
//! and the scatter-adds that are their backward (`scatter_add`, `index_add`). The addressed dim
//! may be split across ranks (a vocabulary split): each rank reads or writes only the indices
//! inside its region, whose start and the dim's global size the op's local attributes carry.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, NdSbp, RuleMode, Sbp, Shape};

use super::grad::Grad;
use super::{
    kernel_trait, need_float, need_i64, shape_rule, single, Inferred, LocalAt, MetaResult,
    OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// Where a rank's piece sits on the addressed dim: it holds global indices
/// `start..start + (its size there)` of `total`. Indices outside `0..total` are an error;
/// indices of other ranks read zeros and write nothing. The global op holds the default (the
/// dispatcher's `local` fills it in for every call, local ones included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IndexShard {
    pub start: usize,
    pub total: usize,
}

impl IndexShard {
    /// The shard of input `input`'s region on `dim`.
    pub(crate) fn of_input(at: &LocalAt<'_>, input: usize, dim: usize) -> IndexShard {
        IndexShard {
            start: at.input_start(input, dim),
            total: at
                .global_inputs
                .get(input)
                .and_then(|s| s.dims().get(dim).copied())
                .unwrap_or(0),
        }
    }
    /// The shard of the output's region on `dim`.
    pub(crate) fn of_output(at: &LocalAt<'_>, dim: usize) -> IndexShard {
        IndexShard {
            start: at.out_start(dim),
            total: at.out_global.dims().get(dim).copied().unwrap_or(0),
        }
    }
}

/// The gather family. Index inputs are i64.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GatherOp {
    /// (x, index) -> index's shape: `out[.., j, ..] = x[.., index[.., j, ..], ..]` on `dim`.
    Gather { dim: usize, shard: IndexShard },
    /// (index, src) -> zeros of index's shape with `dim` of `size`, `src` added at `index`.
    /// `split_first`: the gathered data was split on `dim` (see `rules::scatter_add`).
    ScatterAdd {
        dim: usize,
        size: usize,
        split_first: bool,
        shard: IndexShard,
    },
    /// (x, ids [n]) -> x with `dim` of size n: `out[.., j, ..] = x[.., ids[j], ..]`.
    IndexSelect { dim: usize, shard: IndexShard },
    /// (ids [n], src) -> zeros of src's shape with `dim` of `size`, src slices added at ids.
    IndexAdd {
        dim: usize,
        size: usize,
        split_first: bool,
        shard: IndexShard,
    },
}

/// How an index array addresses the dim it indexes: one index per element (torch.gather and
/// scatter_add: the indices have the indexed side's shape) or one per position along the dim
/// (index_select, index_add, embedding: any ids shape, flattened).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Addressing {
    PerElement,
    PerPosition,
}

/// Where a gather kernel's indices point: the dim they address on the dense side (the read's
/// input, the scatter's output), how, and the shard of that dim the rank's piece holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Along {
    pub dim: usize,
    pub addressing: Addressing,
    pub shard: IndexShard,
}

impl Along {
    /// One index per position along `dim`.
    pub fn per_position(dim: usize, shard: IndexShard) -> Along {
        Along {
            dim,
            addressing: Addressing::PerPosition,
            shard,
        }
    }
    /// One index per element, along `dim`.
    pub fn per_element(dim: usize, shard: IndexShard) -> Along {
        Along {
            dim,
            addressing: Addressing::PerElement,
            shard,
        }
    }
}

kernel_trait! {
    /// Gather kernels of a backend: the reads (`take`: gather, index_select, embedding lookup) and
    /// the scatter-adds that are their gradients (`put`), `op` naming the op in errors. Data pieces
    /// are float (and i64 for the reads), indices i64; indices outside `0..shard.total` are a typed
    /// error on the CPU (NaN rows on CUDA, which cannot raise one without a sync).
    pub trait GatherKernels {
        /// `out` (the indexed side) gets `x` at `ids` along `along.dim`; zeros for other ranks' ids.
        fn take(op: &'static str, x: &Self::Piece, ids: &Self::Piece, along: Along);
        /// `out` (the dense side) gets zeros plus `src` added at `ids` along `along.dim`; other
        /// ranks' ids are skipped.
        fn put(op: &'static str, ids: &Self::Piece, src: &Self::Piece, along: Along);
    }
}

impl GatherOp {
    /// The scatter-add into a dim of `size` along `dim` (`ScatterAdd` with one index per
    /// element, else `IndexAdd`), the read's gradient; its shard is filled in by `local`.
    pub(crate) fn adding(
        addressing: Addressing,
        dim: usize,
        size: usize,
        split_first: bool,
    ) -> GatherOp {
        let shard = IndexShard::default();
        match addressing {
            Addressing::PerElement => GatherOp::ScatterAdd {
                dim,
                size,
                split_first,
                shard,
            },
            Addressing::PerPosition => GatherOp::IndexAdd {
                dim,
                size,
                split_first,
                shard,
            },
        }
    }
}

impl OpFamily for GatherOp {
    fn name(&self) -> &'static str {
        match self {
            GatherOp::Gather { .. } => "gather",
            GatherOp::ScatterAdd { .. } => "scatter_add",
            GatherOp::IndexSelect { .. } => "index_select",
            GatherOp::IndexAdd { .. } => "index_add",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (2, 2)
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let r = match self {
            GatherOp::Gather { dim, .. } => {
                need_i64(d[1], "index")?;
                return Ok(Inferred::new(
                    shape_rule(rules::gather(*dim, s[0], s[1], mode))?,
                    d[0],
                ));
            }
            GatherOp::IndexSelect { dim, .. } => {
                need_i64(d[1], "ids")?;
                return Ok(Inferred::new(
                    shape_rule(rules::index_select(*dim, s[0], s[1], mode))?,
                    d[0],
                ));
            }
            GatherOp::ScatterAdd {
                dim,
                size,
                split_first,
                ..
            } => rules::scatter_add(*dim, *size, s[0], s[1], *split_first, mode),
            GatherOp::IndexAdd {
                dim,
                size,
                split_first,
                ..
            } => rules::index_add(*dim, *size, s[0], s[1], *split_first, mode),
        };
        need_i64(d[0], "index")?;
        need_float(d[1], "src")?;
        Ok(Inferred::new(shape_rule(r)?, d[1]))
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        let mut op = self.clone();
        match &mut op {
            GatherOp::Gather { dim, shard } | GatherOp::IndexSelect { dim, shard } => {
                *shard = IndexShard::of_input(at, 0, *dim);
            }
            GatherOp::ScatterAdd { dim, shard, .. } | GatherOp::IndexAdd { dim, shard, .. } => {
                *shard = IndexShard::of_output(at, *dim);
            }
        }
        Some(op)
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            // The indices: input 1 of the reads, input 0 of the scatter-adds.
            GatherOp::Gather { .. } | GatherOp::IndexSelect { .. } => Saves::inputs(&[1]),
            GatherOp::ScatterAdd { .. } | GatherOp::IndexAdd { .. } => Saves::inputs(&[0]),
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let dy = g.dy()?;
        match *self {
            GatherOp::Gather { dim, .. } | GatherOp::IndexSelect { dim, .. } => {
                let x = g.input_meta(0);
                let (size, split_first) = (x.shape().dim(dim), split_on(x.nd_sbp(), dim));
                let addressing = match self {
                    GatherOp::Gather { .. } => Addressing::PerElement,
                    _ => Addressing::PerPosition,
                };
                let op = GatherOp::adding(addressing, dim, size, split_first);
                Ok(vec![
                    g.when(0, || Tensor::apply(op, &[g.input(1)?, dy]))?,
                    None,
                ])
            }
            // Linear in src: the gradient reads dy back at the same indices.
            GatherOp::ScatterAdd { dim, .. } => Ok(vec![
                None,
                g.when(1, || dy.gather(dim as isize, g.input(0)?))?,
            ]),
            GatherOp::IndexAdd { dim, .. } => Ok(vec![
                None,
                g.when(1, || dy.index_select(dim as isize, g.input(0)?))?,
            ]),
        }
    }
}

impl<B: GatherKernels> RunKernels<B> for GatherOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let (op, y) = (self.name(), single(self.name(), out)?);
        match *self {
            GatherOp::Gather { dim, shard } => {
                b.take(op, x[0], x[1], Along::per_element(dim, shard), y)
            }
            GatherOp::ScatterAdd { dim, shard, .. } => {
                b.put(op, x[0], x[1], Along::per_element(dim, shard), y)
            }
            GatherOp::IndexSelect { dim, shard } => {
                b.take(op, x[0], x[1], Along::per_position(dim, shard), y)
            }
            GatherOp::IndexAdd { dim, shard, .. } => {
                b.put(op, x[0], x[1], Along::per_position(dim, shard), y)
            }
        }
    }
}

/// Whether a global tensor of nd-SBP `nd` is split on `dim` on some mesh axis.
pub(crate) fn split_on(nd: Option<&NdSbp>, dim: usize) -> bool {
    nd.is_some_and(|s| s.iter().any(|a| a == Sbp::S(dim)))
}
