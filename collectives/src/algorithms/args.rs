//! The argument checks the `Communicator` boundary runs before any backend communicates
//! (buffer sizes, counts, ranks).

use crate::{CommError, DType};

/// `got` bytes must hold exactly `elems` elements of `dtype`.
pub(crate) fn check_len(
    op: &str,
    what: &str,
    dtype: DType,
    got: usize,
    elems: usize,
) -> Result<(), CommError> {
    let expected = bytes_of(op, what, dtype, elems)?;
    if got != expected {
        return Err(CommError::BufferSize {
            op: op.to_string(),
            expected,
            got,
            detail: format!("{what}: {elems} elements of {dtype}"),
        });
    }
    Ok(())
}

/// The bytes of `elems` elements of `dtype`, or an error when they overflow usize.
pub(crate) fn bytes_of(
    op: &str,
    what: &str,
    dtype: DType,
    elems: usize,
) -> Result<usize, CommError> {
    elems
        .checked_mul(dtype.size())
        .ok_or_else(|| CommError::InvalidArgument {
            op: op.to_string(),
            detail: format!("{what}: {elems} elements of {dtype} overflow usize"),
        })
}

/// The list `what` has `n` entries, one per member of a group of `size`.
pub(crate) fn check_entries(op: &str, what: &str, n: usize, size: usize) -> Result<(), CommError> {
    if n == size {
        return Ok(());
    }
    Err(CommError::InvalidArgument {
        op: op.to_string(),
        detail: format!("{what} has {n} entries for a group of {size} members"),
    })
}

/// A whole number of elements of `dtype`; returns the element count.
pub(crate) fn elems_of(op: &str, what: &str, dtype: DType, got: usize) -> Result<usize, CommError> {
    if !got.is_multiple_of(dtype.size()) {
        return Err(CommError::BufferSize {
            op: op.to_string(),
            expected: got - got % dtype.size(),
            got,
            detail: format!("{what}: not a whole number of {dtype} elements"),
        });
    }
    Ok(got / dtype.size())
}

/// The buffers of an out-of-place call: `send_bytes` hold whole elements of `dtype` and
/// `recv_bytes` as many; returns their count.
pub(crate) fn check_into(
    op: &str,
    dtype: DType,
    send_bytes: usize,
    recv_bytes: usize,
) -> Result<usize, CommError> {
    let count = elems_of(op, "send", dtype, send_bytes)?;
    check_len(op, "recv (as long as send)", dtype, recv_bytes, count)?;
    Ok(count)
}

/// One count per member; returns their sum.
pub(crate) fn check_counts(
    op: &str,
    what: &str,
    counts: &[usize],
    size: usize,
) -> Result<usize, CommError> {
    check_entries(op, what, counts.len(), size)?;
    counts
        .iter()
        .try_fold(0usize, |acc, &c| acc.checked_add(c))
        .ok_or_else(|| CommError::InvalidArgument {
            op: op.to_string(),
            detail: format!("{what} {counts:?} overflow usize"),
        })
}

/// A member index below `size`.
pub(crate) fn check_member(
    op: &str,
    what: &str,
    member: usize,
    size: usize,
) -> Result<(), CommError> {
    if member >= size {
        return Err(CommError::InvalidArgument {
            op: op.to_string(),
            detail: format!("{what} {member} is not a member of a group of {size}"),
        });
    }
    Ok(())
}

/// Distinct member indices below `size`, not empty, containing `me`.
pub(crate) fn check_sub_group(
    members: &[usize],
    size: usize,
    me: usize,
) -> Result<usize, CommError> {
    let op = "sub_group";
    if members.is_empty() {
        return Err(CommError::InvalidArgument {
            op: op.to_string(),
            detail: "empty member list".to_string(),
        });
    }
    let mut seen = vec![false; size];
    for &m in members {
        check_member(op, "member", m, size)?;
        if seen[m] {
            return Err(CommError::InvalidArgument {
                op: op.to_string(),
                detail: format!("member {m} listed twice in {members:?}"),
            });
        }
        seen[m] = true;
    }
    members
        .iter()
        .position(|&m| m == me)
        .ok_or_else(|| CommError::InvalidArgument {
            op: op.to_string(),
            detail: format!(
                "called by member {me}, which is not in {members:?} (only members may call it)"
            ),
        })
}

/// Exclusive prefix sums of `counts`, scaled to bytes.
pub(crate) fn byte_offsets(
    counts: &[usize],
    dtype: DType,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    let sz = dtype.size();
    counts.iter().scan(0usize, move |off, &c| {
        let start = *off;
        *off += c * sz;
        Some((start, c * sz))
    })
}

/// An all-to-all member's part for itself: what it sends itself must be what it expects.
pub(crate) fn check_own(
    op: &str,
    me: usize,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<(), CommError> {
    if send_counts[me] != recv_counts[me] {
        return Err(CommError::Mismatch {
            op: op.to_string(),
            detail: format!(
                "member {me} keeps {} elements of its own but expects {}",
                send_counts[me], recv_counts[me]
            ),
        });
    }
    Ok(())
}
