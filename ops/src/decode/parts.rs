//! `DecodeAttentionParts`: decoding attention over a cache cut into `blocks` equal blocks of
//! positions, each block attended to apart: q `[B, 1, H, D]`, caches `[B, P, G, D]` (P a
//! multiple of C = `blocks`), the new key and value `[B, 1, G, D]` and the position `pos` ->
//! `o` `[B, C, H, D]` and `lse` `[B, C, H]` in the compute dtype (f32 for 16-bit data). Block
//! c holds positions `c P/C .. (c + 1) P/C`; it attends over those before `pos`, and the block
//! holding `pos` (the last one past the cache) also over the new key and value. `o` is the
//! block's softmax-weighted values, `lse` the log-sum-exp of its scores (an empty block: zeros
//! and -inf).
//!
//! [`decode_attention_blocks`] merges the blocks into the attention over every position:
//! weights softmax(lse) over the blocks, the sum of the weighted `o`. Its point is the layout:
//! caches split over ranks on their positions (a context-parallel axis keeping each rank's
//! share of a long sequence's keys and values) attend where they lie, and only the blocks'
//! `[B, C, H, D]` results move (a sum over the split blocks, which the engine reduces).

use std::sync::LazyLock;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch_multi, Extern, ExternOp, Inferred, Kernels, LocalAt, MetaError, MetaResult, Result,
    Tensor, TensorError,
};

use super::attend::check_operands;
use super::op_types::DecodeAttentionParts;
use super::{cpu, cuda, DTYPES};
use crate::op_signature::{kernels_without_gradient, op_signature};
use crate::operand_dtypes::kernels_for;

/// Each of `blocks` blocks' attention of q `[B, 1, H, D]` over the cached keys and values
/// `kv_cache` `[B, P, G, D]` (with the new `kv` `[B, 1, G, D]` at `pos`): `(o [B, C, H, D],
/// lse [B, C, H])` (see the module docs).
pub fn decode_attention_parts(
    q: &Tensor,
    kv_cache: (&Tensor, &Tensor),
    kv: (&Tensor, &Tensor),
    pos: &Tensor,
    scale: f64,
    blocks: usize,
) -> Result<(Tensor, Tensor)> {
    let op = Extern::new(DecodeAttentionParts {
        scale,
        blocks,
        first_block: 0,
    });
    let outs = dispatch_multi(op.into(), &[q, kv_cache.0, kv_cache.1, kv.0, kv.1, pos])?;
    match <[Tensor; 2]>::try_from(outs) {
        Ok([o, lse]) => Ok((o, lse)),
        Err(outs) => Err(TensorError::Kernel {
            op: "decode_attention_parts",
            detail: format!("the op gave {} outputs, not 2", outs.len()),
        }),
    }
}

/// The attention of q `[B, 1, H, D]` over the cached keys and values before `pos` and the new
/// ones at it, as [`decode_attention`](super::decode_attention) computes it, by `blocks` blocks
/// of the caches' positions merged (see the module docs): q's dtype, `[B, 1, H, D]`.
pub fn decode_attention_blocks(
    q: &Tensor,
    kv_cache: (&Tensor, &Tensor),
    kv: (&Tensor, &Tensor),
    pos: &Tensor,
    scale: f64,
    blocks: usize,
) -> Result<Tensor> {
    let (o, lse) = decode_attention_parts(q, kv_cache, kv, pos, scale, blocks)?;
    let &[b, c, h, d] = o.shape().dims() else {
        return Err(TensorError::Kernel {
            op: "decode_attention_blocks",
            detail: format!("the blocks' values are {}, not 4-d", o.shape()),
        });
    };
    let weights = lse.softmax(1)?.reshape([b, c, h, 1])?;
    o.mul(&weights)?
        .sum(&[1], false)?
        .cast(q.dtype())?
        .reshape([b, 1, h, d])
}

static KERNELS: LazyLock<Kernels> = LazyLock::new(|| {
    kernels_for::<DecodeAttentionParts>(
        DTYPES,
        cpu::decode_attention_parts,
        cuda::decode_attention_parts,
    )
});

impl ExternOp for DecodeAttentionParts {
    op_signature!("decode_attention_parts", 6);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend(self.scale.to_bits().to_le_bytes());
        key.extend((self.blocks as u64).to_le_bytes());
        key.extend((self.first_block as u64).to_le_bytes());
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let n = check_operands(shapes, dtypes)?;
        if self.blocks == 0 || n.p % self.blocks != 0 {
            return Err(MetaError::Shape(format!(
                "caches of {} positions do not cut into {} equal blocks",
                n.p, self.blocks
            )));
        }
        let o = Shape::new([n.b, self.blocks, n.h, n.d]);
        let lse = Shape::new([n.b, self.blocks, n.h]);
        let w = dtypes[0].compute();
        Ok(Inferred::outputs(
            rules::decode_attention_parts(o, lse, self.blocks, mode),
            &[w, w],
        ))
    }
    fn local(&self, at: &LocalAt<'_>) -> Option<Extern> {
        // A piece of the caches split on their positions starts at a whole block (the rule
        // splits them evenly in blocks).
        let p = at.global_inputs.get(1)?.dims().get(1).copied()?;
        let per = (p / self.blocks.max(1)).max(1);
        Some(Extern::new(DecodeAttentionParts {
            first_block: at.input_start(1, 1) / per,
            ..*self
        }))
    }
    kernels_without_gradient!(KERNELS, "decoding runs without gradients");
}

impl DecodeAttentionParts {
    /// The positions of a block in one rank's call, from its pieces' sizes (caches of
    /// `p_local` positions, `o` of `blocks_local` blocks), or why the pieces do not fit.
    pub(super) fn block_len(
        &self,
        p_local: usize,
        blocks_local: usize,
    ) -> std::result::Result<usize, String> {
        let fits = (blocks_local > 0 && p_local.is_multiple_of(blocks_local))
            || (blocks_local == 0 && p_local == 0);
        if !fits || self.first_block + blocks_local > self.blocks {
            return Err(format!(
                "a piece of {p_local} cached positions in {blocks_local} of {} blocks from block {}",
                self.blocks, self.first_block
            ));
        }
        Ok(p_local.checked_div(blocks_local).unwrap_or(0))
    }

    /// The block holding position `pos` (of caches of `per` positions a block): the one that
    /// attends over the new key and value.
    pub(super) fn owner(&self, pos: usize, per: usize) -> usize {
        (pos / per.max(1)).min(self.blocks.saturating_sub(1))
    }
}
