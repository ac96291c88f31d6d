//! One public call of a communicator as the flight recorder and the trace see it, and the
//! member-and-count check calls on one member's buffer share.

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

/// The checks of a call on one member's buffer (a send, receive, broadcast or reduce): `member`
/// (the `role`: peer or root) is a member and the buffer holds whole elements; their count.
pub(crate) fn member_and_count<T: BackendHooks>(
    c: &T,
    name: &'static str,
    role: &str,
    member: usize,
    dtype: DType,
    bytes: usize,
) -> Result<usize, CommError> {
    args::check_member(name, role, member, Communicator::size(c))?;
    args::elems_of(name, "buffer", dtype, bytes)
}
