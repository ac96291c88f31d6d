//! The ops of a decoding step over a preallocated key/value cache, whose position is a device
//! value (so one captured program serves every step): [`rotary_at`] rotates queries and keys for
//! positions from a device position ([`rotary_qkv_at`]: straight from a fused query/key/value
//! projection, split into the three), [`decode_attention`] attends one query position over the
//! cached keys before it and its own key (grouped-query heads read their group's key/value head
//! in place), [`decode_attention_blocks`] the same by blocks of the cached positions (caches
//! split over ranks on their positions attend where they lie), and [`write_rows`] writes each
//! step's keys and values into the caches, in their own memory where nothing else holds them
//! ([`write_rows_in_place`]).
//!
//! Layouts (`oxiflow_sbp::rules::{rotary_at, rotary_qkv_at, decode_attention,
//! decode_attention_parts, write_rows}`): the batch or the heads split, or all whole; the
//! position broadcast; the blocks' attention and the cache writes also take caches split on
//! their positions. Kernels: CPU and CUDA in f32, f64, bf16
//! and f16 (16-bit inputs computed in f32, f64 in f64). Not differentiable: decoding runs
//! without gradients.

mod attend;
mod cpu;
mod cuda;
mod op_types;
mod parts;
mod qkv;
mod rotary;
mod rows;

pub use attend::decode_attention;
pub use op_types::{DecodeAttention, DecodeAttentionParts, RotaryAt, RotaryQkvAt, WriteRows};
pub use parts::{decode_attention_blocks, decode_attention_parts};
pub use qkv::rotary_qkv_at;
pub use rotary::rotary_at;
pub use rows::{rows_beside, write_rows, write_rows_in_place};

use oxiflow_dtype::DType;

/// The float dtypes of the kernels, with the i64 of a position and the f64 of frequencies.
const DTYPES: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64];

/// A typed error unless `pos` is one i64 position.
fn check_position(shape: &oxiflow_sbp::Shape, dtype: DType) -> oxiflow_tensor::MetaResult<()> {
    if dtype != DType::I64 || shape.numel() != 1 {
        return Err(oxiflow_tensor::MetaError::Shape(format!(
            "the position must be one i64 element, got {dtype} {shape}"
        )));
    }
    Ok(())
}
