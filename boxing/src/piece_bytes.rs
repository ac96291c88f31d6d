//! Byte-level local operations on row-major host pieces: `pack_bytes`, `unpack_bytes` and
//! `copy_box_bytes` walk the contiguous runs of boxes (`Runs`) and copy or reduce them. Every
//! host-memory `LocalPiece` (boxing's `HostPiece`, the tensor crate's CPU piece) calls these,
//! so the copy and reduce logic exists once.

use std::ops::Range;

use oxiflow_collectives::{reduce_into, ReduceOp};
use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use rayon::prelude::*;

use crate::region::{fits, numel, Runs};
use crate::BoxingError;

/// Copies of at least this many bytes are split over the rayon pool.
const PAR_BYTES: usize = 4 << 20;

/// A row-major host piece seen as bytes: its shape, dtype and `shape.numel()` elements.
#[derive(Clone, Copy, Debug)]
pub struct HostBytes<'a> {
    pub shape: &'a Shape,
    pub dtype: DType,
    pub bytes: &'a [u8],
}

/// Copies `src` into `dst` (equal lengths), in parallel when large.
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    if dst.len() >= PAR_BYTES && rayon::current_num_threads() > 1 {
        let chunk = dst
            .len()
            .div_ceil(rayon::current_num_threads())
            .max(1 << 20);
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
    } else {
        dst.copy_from_slice(src);
    }
}

fn local_err(op: &str, detail: String) -> BoxingError {
    BoxingError::Local {
        op: op.into(),
        detail,
    }
}

/// Checks that `bytes` holds exactly `shape.numel()` elements of `dtype`.
fn check_len(op: &str, shape: &Shape, dtype: DType, bytes: usize) -> Result<(), BoxingError> {
    let want = shape.numel().checked_mul(dtype.size());
    if want != Some(bytes) {
        return Err(local_err(
            op,
            format!("a {dtype} piece of shape {shape} does not fit in {bytes} bytes"),
        ));
    }
    Ok(())
}

/// Checks that every region fits `shape` and that their elements fit a flat buffer of
/// `flat_len` elements from `flat_offset`.
fn check_regions(
    op: &str,
    shape: &Shape,
    regions: &[&[Range<usize>]],
    flat_offset: usize,
    flat_len: usize,
) -> Result<(), BoxingError> {
    let mut total = 0usize;
    for r in regions {
        if !fits(shape, r) {
            return Err(local_err(
                op,
                format!("box {r:?} lies outside a piece of shape {shape}"),
            ));
        }
        total = total.saturating_add(numel(r));
    }
    if flat_offset
        .checked_add(total)
        .is_none_or(|end| end > flat_len)
    {
        return Err(local_err(
            op,
            format!(
                "{total} elements at offset {flat_offset} overrun a buffer of {flat_len} elements"
            ),
        ));
    }
    Ok(())
}

/// Checks that two pieces have one dtype (`op` names the caller in the error).
pub fn check_same_dtype(op: &str, a: DType, b: DType) -> Result<(), BoxingError> {
    if a != b {
        return Err(local_err(op, format!("dtype {a} vs {b}")));
    }
    Ok(())
}

/// Copies the elements of each of `regions` of `src`, one after another in row-major order,
/// into the flat buffer `dst` (elements of `src.dtype`) from element `dst_offset`.
pub fn pack_bytes(
    src: HostBytes<'_>,
    regions: &[&[Range<usize>]],
    dst: &mut [u8],
    dst_offset: usize,
) -> Result<(), BoxingError> {
    check_len("pack", src.shape, src.dtype, src.bytes.len())?;
    let es = src.dtype.size();
    check_regions("pack", src.shape, regions, dst_offset, dst.len() / es)?;
    let mut at = dst_offset * es;
    for r in regions {
        for (off, len) in Runs::new(src.shape, r) {
            let (o, l) = (off * es, len * es);
            copy_bytes(&mut dst[at..at + l], &src.bytes[o..o + l]);
            at += l;
        }
    }
    Ok(())
}

/// The inverse of `pack_bytes`: reads consecutive elements of the flat buffer `src` from
/// `src_offset` into each of `regions` of the piece `dst` (shape `dst_shape`, dtype `dtype`);
/// with `op` they are reduced into the present values.
pub fn unpack_bytes(
    dst_shape: &Shape,
    dtype: DType,
    dst: &mut [u8],
    regions: &[&[Range<usize>]],
    src: &[u8],
    src_offset: usize,
    op: Option<ReduceOp>,
) -> Result<(), BoxingError> {
    check_len("unpack", dst_shape, dtype, dst.len())?;
    let es = dtype.size();
    check_regions("unpack", dst_shape, regions, src_offset, src.len() / es)?;
    let mut at = src_offset * es;
    for r in regions {
        for (off, len) in Runs::new(dst_shape, r) {
            let (o, l) = (off * es, len * es);
            let (d, s) = (&mut dst[o..o + l], &src[at..at + l]);
            match op {
                None => copy_bytes(d, s),
                Some(op) => reduce_into(dtype, d, s, op),
            }
            at += l;
        }
    }
    Ok(())
}

/// Copies the box `src_box` of `src` into the box `at` of the piece `dst` (shape `dst_shape`,
/// same dtype, equal box extents), optionally reducing.
pub fn copy_box_bytes(
    dst_shape: &Shape,
    dst: &mut [u8],
    at: &[Range<usize>],
    src: HostBytes<'_>,
    src_box: &[Range<usize>],
    op: Option<ReduceOp>,
) -> Result<(), BoxingError> {
    check_len("copy_box", src.shape, src.dtype, src.bytes.len())?;
    check_len("copy_box", dst_shape, src.dtype, dst.len())?;
    let same_extent =
        at.len() == src_box.len() && at.iter().zip(src_box).all(|(a, b)| a.len() == b.len());
    if !same_extent || !fits(dst_shape, at) || !fits(src.shape, src_box) {
        return Err(local_err(
            "copy_box",
            format!(
                "box {src_box:?} of a piece of shape {} does not match box {at:?} of a piece of shape {dst_shape}",
                src.shape
            ),
        ));
    }
    let k = Runs::first_dim(dst_shape, at).max(Runs::first_dim(src.shape, src_box));
    let es = src.dtype.size();
    let pairs = Runs::from_dim(dst_shape, at, k).zip(Runs::from_dim(src.shape, src_box, k));
    for ((d_off, len), (s_off, _)) in pairs {
        let d = &mut dst[d_off * es..(d_off + len) * es];
        let s = &src.bytes[s_off * es..(s_off + len) * es];
        match op {
            None => copy_bytes(d, s),
            Some(op) => reduce_into(src.dtype, d, s, op),
        }
    }
    Ok(())
}
