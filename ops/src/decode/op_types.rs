//! The decoding ops as values (their attributes), apart from their definitions (`attend.rs`,
//! `parts.rs`, `rotary.rs`, `qkv.rs`, `rows.rs`: rules and kernel tables) so that the kernels (`cpu.rs`,
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

/// Decoding attention by `blocks` equal blocks of the cached positions, each attended to apart,
/// with `scale` on the scores (inputs as [`DecodeAttention`]'s; outputs: each block's attended
/// values and log-sum-exp, see `parts.rs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeAttentionParts {
    pub scale: f64,
    pub blocks: usize,
    /// The first block of this rank's piece of the caches (0 for whole caches; set by the
    /// op's `local`).
    pub first_block: usize,
}

/// Rows written into caches along `dim` from position `at` (see `rows.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRows {
    pub dim: usize,
    pub at: usize,
    /// The rows written, `(first, count)` along `dim` of the rows given; None: all of them.
    /// A rank's part of caches split on `dim` writes the rows that fall in it (set by the op's
    /// `local`).
    pub window: Option<(usize, usize)>,
}

impl WriteRows {
    /// The rows written, `(first, count)`, of `t` given.
    pub(super) fn rows_written(&self, t: usize) -> (usize, usize) {
        self.window.unwrap_or((0, t))
    }
}
