//! `DecodeAttention`: one query position of each sequence over the keys and values cached at
//! positions `0..pos` and its own key and value (position `pos`, a device value), softmax of the
//! scaled scores, no mask beyond that: q `[B, 1, H, D]`, caches `[B, P, G, D]` (P >= pos),
//! new key and value `[B, 1, G, D]` -> o `[B, 1, H, D]`, query head h reading key/value head
//! `h / (H / G)`. Scores and the softmax in f32 (f64 for f64).

use std::sync::LazyLock;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, Extern, ExternOp, Inferred, Kernels, MetaError, MetaResult, Result, Tensor,
};

use super::op_types::{DecodeAttention, MAX_HEAD_DIM};
use super::{check_position, cpu, cuda, DTYPES};
use crate::op_signature::{kernels_without_gradient, op_signature};
use crate::operand_dtypes::kernels_for;

/// The attention of q `[B, 1, H, D]` over the cached keys and values `kc`, `vc` `[B, P, G, D]`
/// before `pos` and the new `k`, `v` `[B, 1, G, D]` at `pos` (one i64 on the device), scores
/// scaled by `scale` (see the module docs).
pub fn decode_attention(
    q: &Tensor,
    kv_cache: (&Tensor, &Tensor),
    kv: (&Tensor, &Tensor),
    pos: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let op = Extern::new(DecodeAttention { scale });
    dispatch(op.into(), &[q, kv_cache.0, kv_cache.1, kv.0, kv.1, pos])
}

/// The sizes of a decoding attention's operands: batch, query heads, key/value heads, head
/// width and cached positions.
pub(super) struct Operands {
    pub b: usize,
    pub h: usize,
    pub g: usize,
    pub d: usize,
    pub p: usize,
}

/// Checks a decoding attention's operands (q, the caches, the new key and value, the
/// position; see the module docs); returns their sizes.
pub(super) fn check_operands(shapes: &[&Shape], dtypes: &[DType]) -> MetaResult<Operands> {
    let (q, kc, vc, k, v) = (shapes[0], shapes[1], shapes[2], shapes[3], shapes[4]);
    let d = dtypes[0];
    if !d.is_float() || dtypes[..5].iter().any(|&x| x != d) {
        return Err(MetaError::DType(format!(
            "q, the caches and the new key and value must share a float dtype, got {:?}",
            &dtypes[..5]
        )));
    }
    let bad = || {
        MetaError::Shape(format!(
            "needs q [B, 1, H, D], caches [B, P, G, D] and key/value [B, 1, G, D] with G \
             dividing H and D <= {MAX_HEAD_DIM}, got q {q}, caches {kc} {vc}, key/value {k} {v}"
        ))
    };
    let (&[b, 1, h, hd], &[b2, p, g, d2]) = (q.dims(), kc.dims()) else {
        return Err(bad());
    };
    let new = [b, 1, g, hd];
    if b2 != b
        || d2 != hd
        || vc != kc
        || k.dims() != new
        || v.dims() != new
        || g == 0
        || h % g != 0
        || hd > MAX_HEAD_DIM
    {
        return Err(bad());
    }
    check_position(shapes[5], dtypes[5])?;
    Ok(Operands { b, h, g, d: hd, p })
}

static KERNELS: LazyLock<Kernels> = LazyLock::new(|| {
    kernels_for::<DecodeAttention>(DTYPES, cpu::decode_attention, cuda::decode_attention)
});

impl ExternOp for DecodeAttention {
    op_signature!("decode_attention", 6);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend(self.scale.to_bits().to_le_bytes());
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let sizes = check_operands(shapes, dtypes)?;
        Ok(Inferred::new(
            rules::decode_attention(shapes[0].clone(), sizes.g, mode),
            dtypes[0],
        ))
    }
    kernels_without_gradient!(KERNELS, "decoding runs without gradients");
}
