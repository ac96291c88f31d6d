//! The one place where `Communicator` arguments are checked: every public method records the
//! call in the flight recorder, checks counts, members, buffer sizes and memory kind, and only
//! then calls the backend's unchecked hook (`BackendHooks`). Every backend therefore rejects
//! bad arguments with the same typed error, before it communicates.

use crate::algorithms::args;
use crate::call::{member_call, reduce_scatter_total, Call};
use crate::communicator::sealed::Sealed;
use crate::exchanged;
use crate::hooks::BackendHooks;
use crate::strided::check_layout;
use crate::widen;
use crate::{
    Backend, Buf, BufMut, CommError, Communicator, DType, ReduceOp, SharedComm, StridedBlock,
};

impl<T: BackendHooks> Sealed for T {}

/// `all_gather_v` under the name of the public call (`all_gather` records as itself).
fn all_gather_named<T: BackendHooks>(
    c: &T,
    name: &'static str,
    dtype: DType,
    send: Buf<'_>,
    recv: BufMut<'_>,
    counts: &[usize],
) -> Result<(), CommError> {
    let check = || {
        let total = args::check_counts(name, "counts", counts, c.world_ranks().len())?;
        args::check_len(name, "send", dtype, send.len_bytes(), counts[c.rank()])?;
        args::check_len(name, "recv", dtype, recv.len_bytes(), total)?;
        Ok((
            c.read(name, "send", send)?,
            c.write(name, "recv", recv)?,
            total,
        ))
    };
    let bytes = send.len_bytes();
    Call::new(c.log(), name, dtype, bytes).run(check, |(s, r, total)| {
        BackendHooks::all_gather_v(c, dtype, s, r, counts, total)
    })
}

/// `reduce_scatter_v` under the name of the public call.
fn reduce_scatter_named<T: BackendHooks>(
    c: &T,
    name: &'static str,
    dtype: DType,
    send: Buf<'_>,
    recv: BufMut<'_>,
    counts: &[usize],
    op: ReduceOp,
) -> Result<(), CommError> {
    if let Some(h) = widen::needed(c, dtype) {
        return widen::reduce_scatter_v(c, name, h, send, recv, counts, op);
    }
    let check = || {
        let total =
            reduce_scatter_total(c, name, dtype, counts, send.len_bytes(), recv.len_bytes())?;
        Ok((
            c.read(name, "send", send)?,
            c.write(name, "recv", recv)?,
            total,
        ))
    };
    let bytes = send.len_bytes();
    Call::new(c.log(), name, dtype, bytes).run(check, |(s, r, total)| {
        BackendHooks::reduce_scatter_v(c, dtype, s, r, counts, total, op)
    })
}

/// Which parts of an all-to-all's send buffer the caller passes: every member's
/// (`all_to_all_v`) or only the other members' (`all_to_all_v_others`).
#[derive(Clone, Copy)]
enum SendParts {
    All,
    Others,
}

/// An all-to-all-v of `parts`: both count lists, the own part (what a member sends itself is
/// what it expects) and both buffers are checked, then the matching hook runs.
fn all_to_all_parts<T: BackendHooks>(
    c: &T,
    parts: SendParts,
    dtype: DType,
    send: Buf<'_>,
    send_counts: &[usize],
    recv: BufMut<'_>,
    recv_counts: &[usize],
) -> Result<(), CommError> {
    let name = match parts {
        SendParts::All => "all_to_all_v",
        SendParts::Others => "all_to_all_v_others",
    };
    let bytes = send.len_bytes();
    let check = || {
        let n = Communicator::size(c);
        let me = BackendHooks::rank(c);
        let stotal = args::check_counts(name, "send_counts", send_counts, n)?;
        let rtotal = args::check_counts(name, "recv_counts", recv_counts, n)?;
        args::check_own(name, me, send_counts, recv_counts)?;
        match parts {
            SendParts::All => args::check_len(name, "send", dtype, bytes, stotal)?,
            SendParts::Others => {
                let what = "send (the other members' parts)";
                args::check_len(name, what, dtype, bytes, stotal - send_counts[me])?
            }
        }
        args::check_len(name, "recv", dtype, recv.len_bytes(), rtotal)?;
        Ok((c.read(name, "send", send)?, c.write(name, "recv", recv)?))
    };
    Call::new(c.log(), name, dtype, bytes).run(check, |(s, r)| match parts {
        SendParts::All => BackendHooks::all_to_all_v(c, dtype, s, send_counts, r, recv_counts),
        SendParts::Others => {
            BackendHooks::all_to_all_v_others(c, dtype, s, send_counts, r, recv_counts)
        }
    })
}

impl<T: BackendHooks> Communicator for T {
    fn rank(&self) -> usize {
        BackendHooks::rank(self)
    }
    fn size(&self) -> usize {
        BackendHooks::world_ranks(self).len()
    }
    fn world_ranks(&self) -> &[usize] {
        BackendHooks::world_ranks(self)
    }
    fn backend(&self) -> Backend {
        BackendHooks::backend(self)
    }

    fn all_reduce(&self, dtype: DType, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        if let Some(h) = widen::needed(self, dtype) {
            return widen::all_reduce(self, h, buf, op);
        }
        let name = "all_reduce";
        let bytes = buf.len_bytes();
        let check = || {
            let count = args::elems_of(name, "buffer", dtype, bytes)?;
            Ok((self.write(name, "buffer", buf)?, count))
        };
        Call::new(self.log(), name, dtype, bytes).run(check, |(b, count)| {
            BackendHooks::all_reduce(self, dtype, b, count, op)
        })
    }

    fn all_reduce_into(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        if let Some(h) = widen::needed(self, dtype) {
            return widen::all_reduce_into(self, h, send, recv, op);
        }
        let name = "all_reduce_into";
        let bytes = send.len_bytes();
        let check = || {
            let count = args::check_into(name, dtype, bytes, recv.len_bytes())?;
            let s = self.read(name, "send", send)?;
            Ok((s, self.write(name, "recv", recv)?, count))
        };
        Call::new(self.log(), name, dtype, bytes).run(check, |(s, r, count)| {
            BackendHooks::all_reduce_into(self, dtype, s, r, count, op)
        })
    }

    fn all_gather_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        counts: &[usize],
    ) -> Result<(), CommError> {
        all_gather_named(self, "all_gather_v", dtype, send, recv, counts)
    }

    fn reduce_scatter_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        reduce_scatter_named(self, "reduce_scatter_v", dtype, send, recv, counts, op)
    }

    fn all_to_all_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        all_to_all_parts(
            self,
            SendParts::All,
            dtype,
            send,
            send_counts,
            recv,
            recv_counts,
        )
    }

    fn exchange_counts(&self, send_counts: &[usize]) -> Result<Vec<usize>, CommError> {
        exchanged::exchange_counts(self, send_counts)
    }

    fn all_to_all_v_exchanged(
        &self,
        dtype: DType,
        send: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>), CommError> {
        exchanged::all_to_all_v_exchanged(self, dtype, send, send_counts)
    }

    fn all_to_all_v_others(
        &self,
        dtype: DType,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        all_to_all_parts(
            self,
            SendParts::Others,
            dtype,
            send,
            send_counts,
            recv,
            recv_counts,
        )
    }

    fn all_to_all_v_strided(
        &self,
        dtype: DType,
        send: Buf<'_>,
        send_layout: &[StridedBlock],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let name = "all_to_all_v_strided";
        let bytes = send.len_bytes();
        let check = || {
            let n = Communicator::size(self);
            let me = BackendHooks::rank(self);
            let counts = check_layout(name, dtype, bytes, send_layout, n)?;
            let rtotal = args::check_counts(name, "recv_counts", recv_counts, n)?;
            args::check_len(name, "recv", dtype, recv.len_bytes(), rtotal)?;
            args::check_own(name, me, &counts, recv_counts)?;
            let s = self.read(name, "send", send)?;
            Ok((s, self.write(name, "recv", recv)?, counts))
        };
        Call::new(self.log(), name, dtype, bytes).run(check, |(s, r, counts)| {
            BackendHooks::all_to_all_v_strided(self, dtype, s, send_layout, &counts, r, recv_counts)
        })
    }

    fn broadcast(&self, dtype: DType, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let (name, bytes) = ("broadcast", buf.len_bytes());
        let buffer = || self.write(name, "buffer", buf);
        member_call(self, name, dtype, bytes, ("root", root), buffer, |b, _| {
            BackendHooks::broadcast(self, dtype, b, root)
        })
    }

    fn reduce(
        &self,
        dtype: DType,
        buf: BufMut<'_>,
        root: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        if let Some(h) = widen::needed(self, dtype) {
            return widen::reduce(self, h, buf, root, op);
        }
        let (name, bytes) = ("reduce", buf.len_bytes());
        let buffer = || self.write(name, "buffer", buf);
        member_call(
            self,
            name,
            dtype,
            bytes,
            ("root", root),
            buffer,
            |b, count| BackendHooks::reduce(self, dtype, b, count, root, op),
        )
    }

    fn send(&self, dtype: DType, buf: Buf<'_>, peer: usize) -> Result<(), CommError> {
        let (name, bytes) = ("send", buf.len_bytes());
        let buffer = || self.read(name, "buffer", buf);
        member_call(self, name, dtype, bytes, ("peer", peer), buffer, |b, _| {
            BackendHooks::send(self, dtype, b, peer)
        })
    }

    fn recv(&self, dtype: DType, buf: BufMut<'_>, peer: usize) -> Result<(), CommError> {
        let (name, bytes) = ("recv", buf.len_bytes());
        let buffer = || self.write(name, "buffer", buf);
        member_call(self, name, dtype, bytes, ("peer", peer), buffer, |b, _| {
            BackendHooks::recv(self, dtype, b, peer)
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        Call::control(self.log(), "barrier").run(|| Ok(()), |()| BackendHooks::barrier(self))
    }

    fn sub_group(&self, members: &[usize]) -> Result<SharedComm, CommError> {
        let mut out = None;
        let check = || {
            let n = Communicator::size(self);
            args::check_sub_group(members, n, BackendHooks::rank(self))
        };
        Call::control(self.log(), "sub_group").run(check, |me| {
            out = Some(BackendHooks::sub_group(self, members, me)?);
            Ok(())
        })?;
        out.ok_or_else(|| CommError::InvalidArgument {
            op: "sub_group".into(),
            detail: "the backend returned no communicator".into(),
        })
    }

    fn one_way(&self, from: usize, to: usize) -> Result<SharedComm, CommError> {
        let mut out = None;
        let check = || {
            let n = Communicator::size(self);
            args::check_member("one_way", "from", from, n)?;
            args::check_member("one_way", "to", to, n)?;
            let me = BackendHooks::rank(self);
            match (from == to, [from, to].iter().position(|&m| m == me)) {
                (true, _) => Err(CommError::InvalidArgument {
                    op: "one_way".into(),
                    detail: format!("member {from} to itself"),
                }),
                (false, None) => Err(CommError::InvalidArgument {
                    op: "one_way".into(),
                    detail: format!("member {me} opens the channel from {from} to {to}"),
                }),
                (false, Some(i)) => Ok(i),
            }
        };
        Call::control(self.log(), "one_way").run(check, |me| {
            out = Some(BackendHooks::one_way(self, from, to, me)?);
            Ok(())
        })?;
        out.ok_or_else(|| CommError::InvalidArgument {
            op: "one_way".into(),
            detail: "the backend returned no communicator".into(),
        })
    }

    fn all_gather(&self, dtype: DType, send: Buf<'_>, recv: BufMut<'_>) -> Result<(), CommError> {
        let name = "all_gather";
        let n = args::elems_of(name, "send", dtype, send.len_bytes())?;
        let counts = vec![n; Communicator::size(self)];
        all_gather_named(self, name, dtype, send, recv, &counts)
    }

    fn reduce_scatter(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "reduce_scatter";
        let n = args::elems_of(name, "recv", dtype, recv.len_bytes())?;
        let counts = vec![n; Communicator::size(self)];
        reduce_scatter_named(self, name, dtype, send, recv, &counts, op)
    }
}
