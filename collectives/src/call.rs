//! One public call of a communicator as the flight recorder and the trace see it, and the
//! checks and recording that several public calls share (calls on one member's buffer, and a
//! reduce-scatter's counts, alike whether or not its reduction is widened).

use std::borrow::Cow;

use crate::algorithms::args;
use crate::flight::{flight_recorder, CommLog};
use crate::hooks::BackendHooks;
use crate::trace::{trace_end, trace_start, Lane};
use crate::{CommError, Communicator, DType};

/// One public call as the flight recorder and the trace see it: the communicator's log, the
/// call's name, its dtype's name, its bytes and its peer or root.
pub(crate) struct Call<'l> {
    log: &'l CommLog,
    name: &'static str,
    dtype: &'static str,
    bytes: usize,
    peer: Option<usize>,
}

impl<'l> Call<'l> {
    /// A call moving `bytes` of `dtype`.
    pub(crate) fn new(log: &'l CommLog, name: &'static str, dtype: DType, bytes: usize) -> Self {
        Call {
            log,
            name,
            dtype: dtype.as_str(),
            bytes,
            peer: None,
        }
    }

    /// A call that moves no data of its own (a barrier, a sub-group's creation).
    pub(crate) fn control(log: &'l CommLog, name: &'static str) -> Self {
        Call {
            log,
            name,
            dtype: "",
            bytes: 0,
            peer: None,
        }
    }

    /// The same call with a peer or root.
    pub(crate) fn with_peer(self, peer: usize) -> Self {
        Call {
            peer: Some(peer),
            ..self
        }
    }

    /// Records the call, runs `check` (which turns the arguments into the hook's), then `run`.
    pub(crate) fn run<X>(
        self,
        check: impl FnOnce() -> Result<X, CommError>,
        run: impl FnOnce(X) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let Call {
            log,
            name,
            dtype,
            bytes,
            peer,
        } = self;
        let recorder = flight_recorder();
        let traced = trace_start();
        let ticket = log.begin(name, dtype, bytes, peer);
        let result = check().and_then(|x| {
            recorder.start(ticket);
            run(x)
        });
        recorder.finish(ticket, result.as_ref().map(|_| ()));
        trace_end(
            traced,
            Lane::Collectives,
            || Cow::Borrowed(name),
            || {
                vec![
                    ("bytes", bytes.into()),
                    ("dtype", dtype.into()),
                    ("group", log.group().into()),
                ]
            },
        );
        result
    }
}

/// A call on this member's one buffer (`bytes` long) with a peer or root (its role and member
/// index), as a send, receive, broadcast or reduce makes it: the peer is checked to be a member
/// and the buffer to hold whole elements of `dtype`, `buffer` then turns the buffer into the
/// hook's, and `run` gets that and the element count. The call is recorded with the peer.
pub(crate) fn member_call<T: BackendHooks, B>(
    c: &T,
    name: &'static str,
    dtype: DType,
    bytes: usize,
    (role, member): (&str, usize),
    buffer: impl FnOnce() -> Result<B, CommError>,
    run: impl FnOnce(B, usize) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let check = || {
        args::check_member(name, role, member, Communicator::size(c))?;
        let count = args::elems_of(name, "buffer", dtype, bytes)?;
        Ok((buffer()?, count))
    };
    Call::new(c.log(), name, dtype, bytes)
        .with_peer(member)
        .run(check, |(b, count)| run(b, count))
}

/// The checks of a reduce-scatter-v: one count per member, `send_bytes` hold their sum and
/// `recv_bytes` this member's count; returns the sum.
pub(crate) fn reduce_scatter_total<T: BackendHooks>(
    c: &T,
    name: &'static str,
    dtype: DType,
    counts: &[usize],
    send_bytes: usize,
    recv_bytes: usize,
) -> Result<usize, CommError> {
    let total = args::check_counts(name, "counts", counts, c.world_ranks().len())?;
    args::check_len(name, "send", dtype, send_bytes, total)?;
    args::check_len(name, "recv", dtype, recv_bytes, counts[c.rank()])?;
    Ok(total)
}
