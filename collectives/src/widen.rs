//! Reductions of 16-bit floats on backends that reduce on the host (in-process, CPU, MPI):
//! every member widens its contribution to f32, the backend reduces the f32 values in its
//! fixed member order, and the result is rounded to 16 bits once, so every member gets
//! bitwise-identical values equal to the f32 reduction rounded once. The public method checks
//! the caller's arguments against the 16-bit dtype first (so errors name it) and then runs as
//! the f32 hook, recorded as the caller's 16-bit call. Backends that reduce 16-bit data themselves (NCCL) say so
//! through `BackendHooks::reduces_half`.

use oxiflow_dtype::Half;

use crate::algorithms::args;
use crate::call::{member_call, reduce_scatter_total, Call};
use crate::hooks::BackendHooks;
use crate::{Buf, BufMut, CommError, DType, ReduceOp};

/// The 16-bit float a reduction of `dtype` on `c` must widen, if any.
pub(crate) fn needed<T: BackendHooks>(c: &T, dtype: DType) -> Option<Half> {
    dtype.half().filter(|_| !c.reduces_half())
}

/// The host bytes of a read buffer (device memory gets the backend's own refusal).
fn host<'a, T: BackendHooks>(
    c: &T,
    op: &str,
    what: &str,
    b: Buf<'a>,
) -> Result<&'a [u8], CommError> {
    match b {
        Buf::Host(h) => Ok(h),
        d => {
            c.read(op, what, d)?;
            Err(not_host(op, what))
        }
    }
}

fn host_mut<'a, T: BackendHooks>(
    c: &T,
    op: &str,
    what: &str,
    b: BufMut<'a>,
) -> Result<&'a mut [u8], CommError> {
    match b {
        BufMut::Host(h) => Ok(h),
        d => {
            c.write(op, what, d)?;
            Err(not_host(op, what))
        }
    }
}

fn not_host(op: &str, what: &str) -> CommError {
    CommError::InvalidArgument {
        op: op.into(),
        detail: format!("{what}: a 16-bit float reduction on this backend needs host memory"),
    }
}

fn f32_bytes(v: &mut [f32]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

/// `contribution` widened to f32 and reduced in place by `reduce` (an f32 hook on the widened
/// buffer, as buffer `what` of `op`): the f32 result.
fn reduce_widened<T: BackendHooks>(
    c: &T,
    h: Half,
    (op, what): (&str, &str),
    contribution: &[u8],
    reduce: impl FnOnce(T::Write<'_>) -> Result<(), CommError>,
) -> Result<Vec<f32>, CommError> {
    let mut wide = h.widened(contribution);
    let w = c.write(op, what, BufMut::Host(f32_bytes(&mut wide)))?;
    reduce(w)?;
    Ok(wide)
}

pub(crate) fn all_reduce<T: BackendHooks>(
    c: &T,
    h: Half,
    buf: BufMut<'_>,
    op: ReduceOp,
) -> Result<(), CommError> {
    let name = "all_reduce";
    let bytes = buf.len_bytes();
    let check = || {
        let count = args::elems_of(name, "buffer", h.dtype(), bytes)?;
        Ok((host_mut(c, name, "buffer", buf)?, count))
    };
    let run = |(buf, count): (&mut [u8], usize)| {
        let wide = reduce_widened(c, h, (name, "buffer"), buf, |w| {
            BackendHooks::all_reduce(c, DType::F32, w, count, op)
        })?;
        h.narrow(&wide, buf);
        Ok(())
    };
    Call::new(c.log(), name, h.dtype(), bytes).run(check, run)
}

pub(crate) fn all_reduce_into<T: BackendHooks>(
    c: &T,
    h: Half,
    send: Buf<'_>,
    recv: BufMut<'_>,
    op: ReduceOp,
) -> Result<(), CommError> {
    let name = "all_reduce_into";
    let bytes = send.len_bytes();
    let check = || {
        let count = args::check_into(name, h.dtype(), bytes, recv.len_bytes())?;
        let s = host(c, name, "send", send)?;
        Ok((s, host_mut(c, name, "recv", recv)?, count))
    };
    let run = |(send, recv, count): (&[u8], &mut [u8], usize)| {
        let wide = reduce_widened(c, h, (name, "recv"), send, |w| {
            BackendHooks::all_reduce(c, DType::F32, w, count, op)
        })?;
        h.narrow(&wide, recv);
        Ok(())
    };
    Call::new(c.log(), name, h.dtype(), bytes).run(check, run)
}

pub(crate) fn reduce_scatter_v<T: BackendHooks>(
    c: &T,
    name: &'static str,
    h: Half,
    send: Buf<'_>,
    recv: BufMut<'_>,
    counts: &[usize],
    op: ReduceOp,
) -> Result<(), CommError> {
    let bytes = send.len_bytes();
    let check = || {
        let total = reduce_scatter_total(c, name, h.dtype(), counts, bytes, recv.len_bytes())?;
        let s = host(c, name, "send", send)?;
        Ok((s, host_mut(c, name, "recv", recv)?, total))
    };
    let run = |(send, recv, total): (&[u8], &mut [u8], usize)| {
        let wide_send = h.widened(send);
        let mut wide_recv = vec![0f32; counts[c.rank()]];
        let s = c.read(name, "send", Buf::Host(bytemuck::cast_slice(&wide_send)))?;
        let r = c.write(name, "recv", BufMut::Host(f32_bytes(&mut wide_recv)))?;
        BackendHooks::reduce_scatter_v(c, DType::F32, s, r, counts, total, op)?;
        h.narrow(&wide_recv, recv);
        Ok(())
    };
    Call::new(c.log(), name, h.dtype(), bytes).run(check, run)
}

pub(crate) fn reduce<T: BackendHooks>(
    c: &T,
    h: Half,
    buf: BufMut<'_>,
    root: usize,
    op: ReduceOp,
) -> Result<(), CommError> {
    let (name, bytes) = ("reduce", buf.len_bytes());
    let buffer = || host_mut(c, name, "buffer", buf);
    let run = |buf: &mut [u8], count| {
        let wide = reduce_widened(c, h, (name, "buffer"), buf, |w| {
            BackendHooks::reduce(c, DType::F32, w, count, root, op)
        })?;
        if c.rank() == root {
            h.narrow(&wide, buf);
        }
        Ok(())
    };
    member_call(c, name, h.dtype(), bytes, ("root", root), buffer, run)
}
