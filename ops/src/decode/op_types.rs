//! The decoding ops as values (their attributes), apart from their definitions (`attend.rs`,
//! `rotary.rs`, `qkv.rs`, `rows.rs`: rules and kernel tables) so that the kernels (`cpu.rs`,
//! `cuda.rs`) and the definitions both build on them.

/// The rotary embedding at a device position (inputs: x, inv_freq, pos).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryAt;

/// A fused query/key/value projection split into q, k and v, q and k rotated at a device
/// position (inputs: qkv, inv_freq, pos; outputs: q, k, v).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryQkvAt;

/// Decoding attention with `scale` on the scores (inputs: q, k cache, v cache, k, v, pos).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeAttention {
    pub scale: f64,
}

/// The kernels' widest head (the CUDA kernel keeps D / 32 elements a lane).
pub(super) const MAX_HEAD_DIM: usize = 256;

/// Rows written into caches along `dim` from position `at` (see `rows.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRows {
    pub dim: usize,
    pub at: usize,
}
