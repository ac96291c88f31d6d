//! Strided send blocks of `Communicator::all_to_all_v_strided`: the public `StridedBlock` (in
//! elements), its checks, the packing the default implementation does, and `Runs`, the byte
//! view backends copy from without packing.

use crate::algorithms::args;
use crate::{CommError, DType};

/// One destination's part of a send buffer, in elements: `runs` runs of `run_len` consecutive
/// elements, starting at `offset`, `offset + stride`, `offset + 2 * stride`, ... The part of a
/// row-major n-d array whose one dim is restricted to a range (a column block of a matrix, the
/// part of a split dim) is such a block: `runs` = product of the dims before it, `run_len` =
/// range length times the product of the dims after it, `stride` = that dim's full length
/// times the same product. Its elements go out in run order. A block with no element
/// (`runs == 0` or `run_len == 0`) ignores `offset` and `stride`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StridedBlock {
    pub offset: usize,
    pub run_len: usize,
    pub stride: usize,
    pub runs: usize,
}

impl StridedBlock {
    /// `len` consecutive elements from `offset`.
    pub fn contiguous(offset: usize, len: usize) -> StridedBlock {
        StridedBlock {
            offset,
            run_len: len,
            stride: len,
            runs: 1,
        }
    }

    /// Elements the block holds (saturating; `check_layout` rejects overflow).
    pub fn count(&self) -> usize {
        self.run_len.saturating_mul(self.runs)
    }

    /// One past the last element the block touches, or None on overflow (0 when empty).
    fn end(&self) -> Option<usize> {
        if self.count() == 0 {
            return Some(0);
        }
        (self.runs - 1)
            .checked_mul(self.stride)?
            .checked_add(self.run_len)?
            .checked_add(self.offset)
    }
}

/// Checks `layout` (one block per member of a group of `n`) against a send buffer of
/// `send_bytes` bytes of `dtype`; returns the element count of each block.
pub(crate) fn check_layout(
    op: &str,
    dtype: DType,
    send_bytes: usize,
    layout: &[StridedBlock],
    n: usize,
) -> Result<Vec<usize>, CommError> {
    args::check_entries(op, "send_layout", layout.len(), n)?;
    let elems = args::elems_of(op, "send buffer", dtype, send_bytes)?;
    let mut counts = Vec::with_capacity(n);
    for (j, b) in layout.iter().enumerate() {
        let end = b
            .run_len
            .checked_mul(b.runs)
            .and_then(|c| c.checked_mul(dtype.size()))
            .and_then(|_| b.end());
        match end {
            None => {
                return Err(CommError::InvalidArgument {
                    op: op.to_string(),
                    detail: format!("block for member {j} {b:?} of {dtype} overflows usize"),
                })
            }
            Some(e) if e > elems => {
                return Err(CommError::BufferSize {
                    op: op.to_string(),
                    expected: e * dtype.size(),
                    got: send_bytes,
                    detail: format!(
                        "send buffer: block for member {j} {b:?} ends at element {e}, the \
                         buffer holds {elems} elements of {dtype}"
                    ),
                });
            }
            Some(_) => counts.push(b.count()),
        }
    }
    Ok(counts)
}

/// The blocks of `layout` (already checked) one after the other, in member order.
pub(crate) fn pack(send: &[u8], layout: &[StridedBlock], dtype: DType) -> Vec<u8> {
    let total: usize = layout.iter().map(|b| b.count() * dtype.size()).sum();
    let mut out = Vec::with_capacity(total);
    for b in layout {
        let r = Runs::of(send, b, dtype);
        r.segments(0, usize::MAX, usize::MAX, |s| out.extend_from_slice(s));
    }
    out
}

/// A block as bytes: `len` bytes made of runs of `run` bytes, `stride` apart, from the start
/// of `base` (which ends with the last run). Contiguous when `run == len`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Runs<'a> {
    base: &'a [u8],
    run: usize,
    stride: usize,
    len: usize,
}

impl<'a> Runs<'a> {
    /// All of `b`.
    pub fn contiguous(b: &'a [u8]) -> Runs<'a> {
        Runs {
            base: b,
            run: b.len(),
            stride: b.len(),
            len: b.len(),
        }
    }

    /// Block `b` of `send` (`check_layout` has accepted it).
    pub fn of(send: &'a [u8], b: &StridedBlock, dtype: DType) -> Runs<'a> {
        let sz = dtype.size();
        if b.count() == 0 {
            return Runs::contiguous(&[]);
        }
        let start = (b.offset * sz).min(send.len());
        let end = b.end().map_or(send.len(), |e| (e * sz).min(send.len()));
        Runs {
            base: &send[start..end.max(start)],
            run: b.run_len * sz,
            stride: b.stride * sz,
            len: b.count() * sz,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes per run (the whole length when contiguous).
    pub fn run(&self) -> usize {
        self.run
    }
    pub fn stride(&self) -> usize {
        self.stride
    }
    /// Address of the block's first byte.
    pub fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Calls `f` on the consecutive pieces of logical bytes `lo..hi` (clamped to the length),
    /// at most `max` of them; returns how many bytes they cover.
    pub fn segments(&self, lo: usize, hi: usize, max: usize, mut f: impl FnMut(&'a [u8])) -> usize {
        let hi = hi.min(self.len);
        let mut p = lo;
        let mut k = 0;
        while p < hi && k < max {
            let (i, o) = (p / self.run, p % self.run);
            let at = i * self.stride + o;
            let l = (self.run - o).min(hi - p);
            match self.base.get(at..at + l) {
                Some(s) => f(s),
                None => break,
            }
            p += l;
            k += 1;
        }
        p.saturating_sub(lo)
    }

    /// Copies logical bytes `lo..lo + dst.len()` into `dst`.
    pub fn copy_to(&self, lo: usize, dst: &mut [u8]) {
        let mut at = 0;
        self.segments(lo, lo.saturating_add(dst.len()), usize::MAX, |s| {
            dst[at..at + s.len()].copy_from_slice(s);
            at += s.len();
        });
    }
}
