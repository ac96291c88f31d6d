//! The all-to-all-v whose receive counts are data (the tokens a mixture of experts routes to
//! each rank): the members first exchange their send counts (a small all-to-all of one i64 per
//! member pair), so each learns what it receives, then the data moves by `all_to_all_v`. Both
//! steps are ordinary public calls: checked at the boundary, recorded by the flight recorder,
//! every wait bounded by the communicator's timeout.

use crate::algorithms::args;
use crate::{CommError, Communicator, DType};

/// What each member sends `c`'s own member: entry `i` is member i's `send_counts[c.rank()]`.
pub(crate) fn exchange_counts<C: Communicator + ?Sized>(
    c: &C,
    send_counts: &[usize],
) -> Result<Vec<usize>, CommError> {
    let name = "exchange_counts";
    let n = c.size();
    args::check_counts(name, "send_counts", send_counts, n)?;
    let send = send_counts
        .iter()
        .map(|&s| i64::try_from(s))
        .collect::<Result<Vec<i64>, _>>()
        .map_err(|_| CommError::InvalidArgument {
            op: name.into(),
            detail: format!("send_counts {send_counts:?} do not fit in i64"),
        })?;
    let mut recv = vec![0i64; n];
    let ones = vec![1usize; n];
    c.all_to_all_v(
        DType::I64,
        bytemuck::cast_slice::<i64, u8>(&send).into(),
        &ones,
        bytemuck::cast_slice_mut::<i64, u8>(&mut recv).into(),
        &ones,
    )?;
    recv.iter()
        .enumerate()
        .map(|(i, &r)| {
            usize::try_from(r).map_err(|_| CommError::Mismatch {
                op: name.into(),
                detail: format!("member {i} says it sends {r} elements"),
            })
        })
        .collect()
}

/// `send` (`send_counts[j]` elements of `dtype` for member j, in member order) to every
/// member; returns what arrived (member i's part, `recv_counts[i]` elements, in member order)
/// and `recv_counts`.
pub(crate) fn all_to_all_v_exchanged<C: Communicator + ?Sized>(
    c: &C,
    dtype: DType,
    send: &[u8],
    send_counts: &[usize],
) -> Result<(Vec<u8>, Vec<usize>), CommError> {
    let name = "all_to_all_v_exchanged";
    let total = args::check_counts(name, "send_counts", send_counts, c.size())?;
    args::check_len(name, "send", dtype, send.len(), total)?;
    let recv_counts = exchange_counts(c, send_counts)?;
    let rtotal = args::check_counts(name, "the received counts", &recv_counts, c.size())?;
    let mut recv = vec![0u8; args::bytes_of(name, "the received counts", dtype, rtotal)?];
    c.all_to_all_v(
        dtype,
        send.into(),
        send_counts,
        (&mut recv[..]).into(),
        &recv_counts,
    )?;
    Ok((recv, recv_counts))
}
