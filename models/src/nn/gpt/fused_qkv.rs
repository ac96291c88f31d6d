//! `FusedQkv`: an attention's query, key and value projections as one product for decoding.
//! The weight `[C, G, (R + 2) D]` holds, per key/value group, its R query heads' columns, its
//! key's and its value's (the bias `[G, (R + 2) D]` likewise), so a split of the groups over
//! the tensor-parallel axis gives each rank its own heads of all three, as the separate
//! projections' column splits do. A decoding step runs the product once and splits and
//! rotates its output with one op (`oxiflow_ops::decode::rotary_qkv_at`), where it ran three
//! products, two rotations and their launches. The tensors are copies of the projections'
//! compute values, made once and written again in place by [`FusedQkv::refresh`] (their
//! memory stays where a captured step reads it).

use oxiflow_ops::decode::{rotary_qkv_at, write_rows_in_place};
use oxiflow_ops::linear::linear_at;
use oxiflow_ops::linear::Activation;
use oxiflow_tensor::{MatmulPrecision, Tensor};

use super::super::linear::Linear;
use super::rope::Rope;
use crate::{Result, TensorError};

/// One attention's fused query/key/value projection (see the module docs).
#[derive(Clone, Debug)]
pub struct FusedQkv {
    /// `[C, G, (R + 2) D]`.
    pub weight: Tensor,
    /// `[G, (R + 2) D]`, where the projections have biases.
    pub bias: Option<Tensor>,
    /// Query heads a group (R) and the head width (D).
    group: usize,
    head_dim: usize,
}

/// The projections' compute values, each grouped: q's `[.., G, R D]`, k's and v's
/// `[.., G, D]` (the weights with C in front, the biases without).
struct Pieces {
    weights: [Tensor; 3],
    biases: Option<[Tensor; 3]>,
}

/// The query, key and value projections of an attention with H query heads in G groups.
#[derive(Clone, Copy)]
pub(super) struct Projections<'a> {
    pub q: &'a Linear,
    pub k: &'a Linear,
    pub v: &'a Linear,
    pub heads: (usize, usize),
}

impl FusedQkv {
    /// The fused projection of `p` (whose caller checked that they fuse).
    pub(super) fn new(p: Projections<'_>) -> Result<FusedQkv> {
        let pieces = Pieces::of(p)?;
        let concat =
            |ts: &[Tensor; 3], dim: usize| Tensor::concat(&[&ts[0], &ts[1], &ts[2]], dim as isize);
        let weight = concat(&pieces.weights, 2)?;
        let bias = pieces.biases.as_ref().map(|b| concat(b, 1)).transpose()?;
        let (h, g) = p.heads;
        Ok(FusedQkv {
            weight,
            bias,
            group: h / g.max(1),
            head_dim: p.q.out_features / h.max(1),
        })
    }

    /// The same fused projection over other tensors of the same shapes (a step's inputs).
    pub(super) fn with(&self, weight: Tensor, bias: Option<Tensor>) -> FusedQkv {
        FusedQkv {
            weight,
            bias,
            group: self.group,
            head_dim: self.head_dim,
        }
    }

    /// Writes the current compute values of `p` (the projections this was made from) into
    /// these tensors, in their own memory where nothing else holds it (else into new tensors
    /// put in their place).
    pub(super) fn refresh(&mut self, p: Projections<'_>) -> Result<()> {
        let pieces = Pieces::of(p)?;
        let (r, d) = (self.group, self.head_dim);
        let starts = [0, r * d, (r + 1) * d];
        refill(&mut self.weight, &pieces.weights, 2, &starts)?;
        if let (Some(bias), Some(bs)) = (self.bias.as_mut(), &pieces.biases) {
            refill(bias, bs, 1, &starts)?;
        }
        Ok(())
    }

    /// q `[B, T, H, D]` and k, v `[B, T, G, D]` of x `[B, T, C]` at positions from the device
    /// position `pos`, q and k rotated by `rope`: the product at `precision`, then one split
    /// and rotation.
    pub(super) fn project_at(
        &self,
        x: &Tensor,
        rope: &Rope,
        pos: &Tensor,
        precision: MatmulPrecision,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dims = self.weight.shape().dims().to_vec();
        let &[c, g, width] = dims.as_slice() else {
            return Err(TensorError::Shape {
                op: "FusedQkv::project_at",
                shapes: self.weight.shape().to_string(),
                sbps: String::new(),
                detail: "the fused weight must be [C, G, (R + 2) D]".into(),
            });
        };
        let w = self.weight.reshape([c, g * width])?;
        let y = match &self.bias {
            Some(b) => linear_at(
                x,
                &w,
                Some(&b.reshape([g * width])?),
                Activation::None,
                precision,
            )?,
            None => x.matmul_at(&w, precision)?,
        };
        let (b, t) = (x.shape().dim(0), x.shape().dim(1));
        let y = y.reshape([b, t, g, self.group + 2, self.head_dim])?;
        rotary_qkv_at(&y, &rope.frequencies_on(y.placement())?, pos)
    }
}

/// Writes each of `pieces` into `target` along `dim` from its start in `starts`, in
/// `target`'s own memory where nothing else holds it (else into a new tensor put in its
/// place).
pub(super) fn refill(
    target: &mut Tensor,
    pieces: &[Tensor],
    dim: usize,
    starts: &[usize],
) -> Result<()> {
    for (piece, &at) in pieces.iter().zip(starts) {
        write_rows_in_place(std::slice::from_mut(target), &[piece], dim, at)?;
    }
    Ok(())
}

impl Pieces {
    /// The compute values of `p` grouped.
    fn of(p: Projections<'_>) -> Result<Pieces> {
        let (h, g) = p.heads;
        let d = p.q.out_features / h.max(1);
        let c = p.q.in_features;
        let widths = [(h / g.max(1)) * d, d, d];
        let linears = [p.q, p.k, p.v];
        let mut weights = Vec::with_capacity(3);
        for (l, &w) in linears.iter().zip(&widths) {
            weights.push(l.weight.compute()?.reshape([c, g, w])?);
        }
        let mut biases = Vec::with_capacity(3);
        for (l, &w) in linears.iter().zip(&widths) {
            if let Some(b) = &l.bias {
                biases.push(b.compute()?.reshape([g, w])?);
            }
        }
        Ok(Pieces {
            weights: three(weights)?,
            biases: (biases.len() == 3).then(|| three(biases)).transpose()?,
        })
    }
}

/// Three tensors as an array.
fn three(v: Vec<Tensor>) -> Result<[Tensor; 3]> {
    <[Tensor; 3]>::try_from(v).map_err(|v| TensorError::Shape {
        op: "FusedQkv",
        shapes: format!("{} pieces", v.len()),
        sbps: String::new(),
        detail: "q, k and v make three".into(),
    })
}
