//! Layout ops: permute (and transpose), reshape, concat, narrow (slice along one dim), and
//! elements (a run of a flat tensor's elements, a view like a reshape).

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Rules, Shape};

use super::grad::{zeros_on, Grad};
use super::{
    dim_ok, kernel_trait, same_dtype, shape_rule, single, Dims, Inferred, LocalAt, MetaResult,
    OpFamily, RunKernels, Saves, ViewOf,
};
use crate::tensor::Tensor;
use crate::Result;

/// The layout family.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LayoutOp {
    /// Output dim i is input dim `perm[i]`.
    Permute {
        perm: Dims,
    },
    /// Row-major reshape (same element count); `local` gives each rank its piece's shape.
    Reshape {
        shape: Shape,
    },
    Concat {
        dim: usize,
    },
    Narrow {
        dim: usize,
        start: usize,
        len: usize,
    },
    /// Elements `start..start + len` of a 1-d tensor: a view of its memory where the backend
    /// can share it (as a reshape is), so a compiled step records it as a view too.
    Elements {
        start: usize,
        len: usize,
    },
}

kernel_trait! {
    /// Layout kernels of a backend; outputs are row-major contiguous. A reshape and an elements run
    /// as views (`OpFamily::view_of`), so `copy` and `narrow` run for them only where a caller
    /// asks for a copy.
    pub trait LayoutKernels {
        fn permute(x: &Self::Piece, perm: &[usize]);
        /// `x`'s elements, in order, into `out` (same count; a reshape that copies).
        fn copy(x: &Self::Piece);
        fn concat(parts: &[&Self::Piece], dim: usize);
        fn narrow(x: &Self::Piece, dim: usize, start: usize, len: usize);
    }
}

impl OpFamily for LayoutOp {
    fn name(&self) -> &'static str {
        match self {
            LayoutOp::Permute { .. } => "permute",
            LayoutOp::Reshape { .. } => "reshape",
            LayoutOp::Concat { .. } => "concat",
            LayoutOp::Narrow { .. } => "narrow",
            LayoutOp::Elements { .. } => "elements",
        }
    }

    fn arity(&self) -> (usize, usize) {
        match self {
            LayoutOp::Concat { .. } => (1, usize::MAX),
            _ => (1, 1),
        }
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let r = match self {
            LayoutOp::Permute { perm } => rules::permute(perm, s[0], mode),
            LayoutOp::Reshape { shape } => rules::reshape(s[0], shape, mode),
            LayoutOp::Concat { dim } => {
                same_dtype(d)?;
                dim_ok(s[0], *dim)?;
                rules::concat(*dim, s, mode)
            }
            LayoutOp::Narrow { dim, start, len } => {
                dim_ok(s[0], *dim)?;
                slice_rule(*dim, *start, *len, s[0], mode)
            }
            LayoutOp::Elements { start, len } => {
                if s[0].ndim() == 1 {
                    slice_rule(0, *start, *len, s[0], mode)
                } else {
                    Err(format!("elements views a 1-d tensor, not {}", s[0]))
                }
            }
        };
        Ok(Inferred::new(shape_rule(r)?, d[0]))
    }

    fn view_of(&self) -> Option<ViewOf> {
        match self {
            LayoutOp::Reshape { .. } => Some(ViewOf { input: 0, start: 0 }),
            LayoutOp::Elements { start, .. } => Some(ViewOf {
                input: 0,
                start: *start,
            }),
            _ => None,
        }
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        match self {
            LayoutOp::Reshape { .. } => Some(LayoutOp::Reshape {
                shape: at.out_local.clone(),
            }),
            _ => None,
        }
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        Saves::NOTHING
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let dy = g.dy()?;
        match self {
            LayoutOp::Permute { perm } => {
                let mut inv = vec![0usize; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                Grad::one(dy.permute(&inv)?)
            }
            LayoutOp::Reshape { .. } => Grad::one(dy.reshape(g.input_meta(0).shape().clone())?),
            LayoutOp::Concat { dim } => {
                let mut start = 0;
                let mut gs = Vec::with_capacity(g.arity());
                for i in 0..g.arity() {
                    let len = g.input_meta(i).shape().dim(*dim);
                    gs.push(g.when(i, || dy.narrow(*dim as isize, start, len))?);
                    start += len;
                }
                Ok(gs)
            }
            LayoutOp::Elements { start, len } => narrow_backward(g, dy, 0, *start, *len),
            LayoutOp::Narrow { dim, start, len } => narrow_backward(g, dy, *dim, *start, *len),
        }
    }
}

impl<B: LayoutKernels> RunKernels<B> for LayoutOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        match self {
            LayoutOp::Permute { perm } => b.permute(x[0], perm, y),
            LayoutOp::Reshape { .. } => b.copy(x[0], y),
            LayoutOp::Concat { dim } => b.concat(x, *dim, y),
            LayoutOp::Narrow { dim, start, len } => b.narrow(x[0], *dim, *start, *len, y),
            LayoutOp::Elements { start, len } => b.narrow(x[0], 0, *start, *len, y),
        }
    }
}

/// The gradient of a narrow of `dim` (or an elements run, dim 0 of a 1-d tensor): `dy` between
/// zeros.
fn narrow_backward(
    g: &Grad<'_>,
    dy: &Tensor,
    dim: usize,
    start: usize,
    len: usize,
) -> Result<Vec<Option<Tensor>>> {
    let full = g.input_meta(0).shape();
    let like = dy.meta();
    let part = |n: usize| zeros_on(&like, full.with_dim(dim, n));
    let before = (start > 0).then(|| part(start)).transpose()?;
    let rest = full.dim(dim).saturating_sub(start + len);
    let after = (rest > 0).then(|| part(rest)).transpose()?;
    let mut parts: Vec<&Tensor> = Vec::new();
    parts.extend(before.as_ref());
    parts.push(dy);
    parts.extend(after.as_ref());
    Grad::one(if parts.len() == 1 {
        dy.clone()
    } else {
        Tensor::concat(&parts, dim as isize)?
    })
}

/// The rules of elements `start..start + len` of `dim` of `shape`, or why they are out of
/// bounds.
fn slice_rule(
    dim: usize,
    start: usize,
    len: usize,
    shape: &Shape,
    mode: RuleMode,
) -> std::result::Result<Rules, String> {
    match start.checked_add(len) {
        Some(end) if end <= shape.dim(dim) => rules::slice(dim, start, end, shape, mode),
        _ => Err(format!(
            "range {start}..{start}+{len} out of bounds for dim {dim} of size {}",
            shape.dim(dim)
        )),
    }
}
