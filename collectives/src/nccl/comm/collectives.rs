//! The backend hooks of `NcclComm`: device buffers of its device, and each collective as NCCL
//! calls (grouped send/recv and broadcasts/reduces for uneven counts) on the comm stream.

use super::*;
use crate::flight::CommLog;
use crate::hooks::BackendHooks;
use crate::DevicePtr;

/// A device buffer of this communicator's device (its size was checked at the boundary).
fn device_buf<'a>(
    op: &str,
    inner: &Inner,
    what: &str,
    host_bytes: Option<usize>,
    d: Option<DevicePtr<'a>>,
) -> Result<DevicePtr<'a>, CommError> {
    let Some(d) = d else {
        return Err(CommError::Unsupported {
            op: op.into(),
            backend: Backend::Nccl.to_string(),
            detail: format!(
                "{what} is host memory ({} bytes); the NCCL backend takes device buffers",
                host_bytes.unwrap_or(0)
            ),
        });
    };
    if d.device != inner.device {
        return Err(CommError::InvalidArgument {
            op: op.into(),
            detail: format!(
                "{what} lives on device {}, the communicator on device {}",
                d.device, inner.device
            ),
        });
    }
    Ok(d)
}

fn offsets(counts: &[usize], esz: usize) -> Vec<usize> {
    let mut o = Vec::with_capacity(counts.len());
    let mut acc = 0;
    for c in counts {
        o.push(acc);
        acc += c * esz;
    }
    o
}

type P = *mut std::ffi::c_void;

/// Readies a call's buffers: registers those in `NcclMemory` with the communicator, and
/// returns their fences when every one of them has a fence (see `Inner::run`).
fn prepare<'a>(
    inner: &Arc<Inner>,
    op: &str,
    bufs: &[DevicePtr<'a>],
) -> Result<Option<Vec<&'a dyn crate::DeviceFence>>, CommError> {
    for d in bufs {
        if d.bytes > 0 {
            memory::ensure_registered(inner, op, d.ptr)?;
        }
    }
    Ok(bufs.iter().map(|d| d.fence).collect())
}

/// One NCCL call on `bufs` (readied by `prepare`): `call` makes it on the comm stream, and its
/// result code is checked under `op`'s name.
fn launch(
    inner: &Arc<Inner>,
    op: &'static str,
    bufs: &[DevicePtr<'_>],
    end: End,
    call: impl FnOnce(&Nccl, ffi::NcclComm, Stream) -> ffi::NcclResult,
) -> Result<(), CommError> {
    let fs = prepare(inner, op, bufs)?;
    inner.run(op, fs.as_deref(), end, |nc, c, s| {
        nc.check(op, c, call(nc, c, s))
    })
}

/// A collective over one piece per member (`counts[k]` elements of member k, in member order):
/// with equal counts the one NCCL call `whole` makes it, otherwise one NCCL group of
/// `piece(root, byte offset, count)` calls, one per member whose piece is not empty.
fn by_pieces(
    comm: &NcclComm,
    op: &'static str,
    dtype: DType,
    bufs: [DevicePtr<'_>; 2],
    counts: &[usize],
    whole: impl FnOnce(&Nccl, ffi::NcclComm, Stream) -> ffi::NcclResult,
    piece: impl Fn(&Nccl, ffi::NcclComm, Stream, usize, u64, usize) -> ffi::NcclResult,
) -> Result<(), CommError> {
    let i = &*comm.inner;
    let equal = counts.iter().all(|&c| c == counts[0]);
    let offs = offsets(counts, dtype.size());
    let fs = prepare(&comm.inner, op, &bufs)?;
    i.run(op, fs.as_deref(), End::Collective, |nc, c, s| {
        if equal {
            return nc.check(op, c, whole(nc, c, s));
        }
        i.group(op, || {
            for (root, &cnt) in counts.iter().enumerate() {
                if cnt > 0 {
                    nc.check(op, c, piece(nc, c, s, root, offs[root] as u64, cnt))?;
                }
            }
            Ok(())
        })
    })
}

/// A new communicator of `world` (world ranks, in member order) under `key`, this member being
/// its member `me`: on `i`'s device, with `i`'s streams, id exchange, timeout and completion.
fn open(i: &Inner, key: String, me: usize, world: Vec<usize>) -> Result<SharedComm, CommError> {
    let comm = NcclComm::create(
        i.nccl,
        i.ctx.clone(),
        lock(&i.compute).clone(),
        i.exchange.clone(),
        key,
        me,
        world,
        i.timeout,
        *lock(&i.completion),
    )?;
    Ok(Arc::new(comm))
}

/// Which way a point-to-point NCCL call moves its buffer.
#[derive(Clone, Copy)]
enum Way {
    Send,
    Recv,
}

impl Way {
    /// The call's name and what its end means to the buffer's owner.
    fn op_end(self) -> (&'static str, End) {
        match self {
            Way::Send => ("send", End::Send),
            Way::Recv => ("recv", End::Collective),
        }
    }

    /// `ncclSend` of, or `ncclRecv` into, `n` elements of `dtype` at `p` with member `peer`.
    ///
    /// # Safety
    /// `p` must be device memory of `n` elements of `dtype` that stays alive (and, for a
    /// receive, unread by others) until the call ends on stream `s`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn call(
        self,
        nc: &Nccl,
        p: P,
        n: usize,
        dtype: DType,
        peer: usize,
        c: ffi::NcclComm,
        s: Stream,
    ) -> ffi::NcclResult {
        // SAFETY: the caller guarantees the buffer; `c` and `s` come from `Inner::run`.
        unsafe {
            match self {
                Way::Send => (nc.send)(p, n, nccl_dtype(dtype), peer as i32, c, s),
                Way::Recv => (nc.recv)(p, n, nccl_dtype(dtype), peer as i32, c, s),
            }
        }
    }
}

/// A single send or receive of a whole checked buffer with member `peer`.
fn point_to_point(
    inner: &Arc<Inner>,
    way: Way,
    dtype: DType,
    buf: DevicePtr<'_>,
    peer: usize,
) -> Result<(), CommError> {
    let (p, n) = (buf.ptr, buf.bytes / dtype.size());
    let (op, end) = way.op_end();
    launch(inner, op, &[buf], end, |nc, c, s| {
        // SAFETY: a send from or a recv into a checked buffer.
        unsafe { way.call(nc, p as P, n, dtype, peer, c, s) }
    })
}

/// All-to-all as one NCCL group of sends and receives. With `own`, the member's own part is
/// in `send` and goes through the group; without, `send` holds only the other members' parts
/// and the own region of `recv` is left as it was (`all_to_all_v_others`).
#[allow(clippy::too_many_arguments)]
fn grouped_all_to_all(
    comm: &NcclComm,
    op: &'static str,
    own: bool,
    dtype: DType,
    send: DevicePtr<'_>,
    send_counts: &[usize],
    recv: DevicePtr<'_>,
    recv_counts: &[usize],
) -> Result<(), CommError> {
    let i = &*comm.inner;
    let me = i.rank;
    let esz = dtype.size();
    // What this member sends to each peer from `send` (nothing to itself without `own`).
    let sent: Vec<usize> = (0..i.size)
        .map(|j| if j == me && !own { 0 } else { send_counts[j] })
        .collect();
    let received: Vec<usize> = (0..i.size)
        .map(|j| if j == me && !own { 0 } else { recv_counts[j] })
        .collect();
    let (sp, rp) = (send.ptr, recv.ptr);
    let so = offsets(&sent, esz);
    let ro = offsets(recv_counts, esz);
    let fs = prepare(&comm.inner, op, &[send, recv])?;
    i.run(op, fs.as_deref(), End::Collective, |nc, c, s| {
        i.group(op, || {
            for peer in 0..i.size {
                let ways = [(Way::Send, sp, &so, &sent), (Way::Recv, rp, &ro, &received)];
                for (way, base, offs, counts) in ways {
                    if counts[peer] > 0 {
                        let p = (base + offs[peer] as u64) as P;
                        // SAFETY: a send from or a recv into a checked sub-range.
                        nc.check(op, c, unsafe {
                            way.call(nc, p, counts[peer], dtype, peer, c, s)
                        })?;
                    }
                }
            }
            Ok(())
        })
    })
}

impl BackendHooks for NcclComm {
    type Read<'a> = DevicePtr<'a>;
    type Write<'a> = DevicePtr<'a>;

    fn rank(&self) -> usize {
        self.inner.rank
    }
    fn backend(&self) -> Backend {
        Backend::Nccl
    }
    /// `ncclBfloat16`/`ncclFloat16` reductions.
    fn reduces_half(&self) -> bool {
        true
    }
    fn log(&self) -> &CommLog {
        &self.inner.log
    }
    fn read<'a>(&self, op: &str, what: &str, b: Buf<'a>) -> Result<DevicePtr<'a>, CommError> {
        match b {
            Buf::Device(d) => device_buf(op, &self.inner, what, None, Some(d)),
            Buf::Host(h) => device_buf(op, &self.inner, what, Some(h.len()), None),
        }
    }
    fn write<'a>(&self, op: &str, what: &str, b: BufMut<'a>) -> Result<DevicePtr<'a>, CommError> {
        match b {
            BufMut::Device(d) => device_buf(op, &self.inner, what, None, Some(d)),
            BufMut::Host(h) => device_buf(op, &self.inner, what, Some(h.len()), None),
        }
    }

    fn all_reduce(
        &self,
        dtype: DType,
        buf: DevicePtr<'_>,
        n: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let p = buf.ptr;
        launch(
            &self.inner,
            "all_reduce",
            &[buf],
            End::Collective,
            |nc, c, s| {
                // SAFETY: in-place all-reduce of n elements of a device buffer of this device
                // whose size the boundary checked.
                unsafe { (nc.all_reduce)(p as P, p as P, n, nccl_dtype(dtype), nccl_op(op), c, s) }
            },
        )
    }

    fn all_reduce_into(
        &self,
        dtype: DType,
        send: DevicePtr<'_>,
        recv: DevicePtr<'_>,
        n: usize,
        rop: ReduceOp,
    ) -> Result<(), CommError> {
        let (sp, rp) = (send.ptr, recv.ptr);
        let bufs = [send, recv];
        launch(
            &self.inner,
            "all_reduce_into",
            &bufs,
            End::Collective,
            |nc, c, s| {
                // SAFETY: out-of-place all-reduce of n elements between checked buffers.
                unsafe {
                    (nc.all_reduce)(sp as P, rp as P, n, nccl_dtype(dtype), nccl_op(rop), c, s)
                }
            },
        )
    }

    fn all_gather_v(
        &self,
        dtype: DType,
        send: DevicePtr<'_>,
        recv: DevicePtr<'_>,
        counts: &[usize],
        _total: usize,
    ) -> Result<(), CommError> {
        let (sp, rp, me) = (send.ptr, recv.ptr, self.inner.rank);
        let dt = nccl_dtype(dtype);
        by_pieces(
            self,
            "all_gather_v",
            dtype,
            [send, recv],
            counts,
            |nc, c, s| {
                // SAFETY: checked buffers: send counts[0], recv size*counts[0] elements.
                unsafe { (nc.all_gather)(sp as P, rp as P, counts[0], dt, c, s) }
            },
            |nc, c, s, root, off, cnt| {
                let dst = rp + off;
                let src = if root == me { sp } else { dst };
                // SAFETY: broadcast of root's piece into its slot of recv.
                unsafe { (nc.broadcast)(src as P, dst as P, cnt, dt, root as i32, c, s) }
            },
        )
    }

    fn reduce_scatter_v(
        &self,
        dtype: DType,
        send: DevicePtr<'_>,
        recv: DevicePtr<'_>,
        counts: &[usize],
        _total: usize,
        rop: ReduceOp,
    ) -> Result<(), CommError> {
        let (sp, rp, me) = (send.ptr, recv.ptr, self.inner.rank);
        let (dt, rop) = (nccl_dtype(dtype), nccl_op(rop));
        by_pieces(
            self,
            "reduce_scatter_v",
            dtype,
            [send, recv],
            counts,
            |nc, c, s| {
                // SAFETY: checked buffers.
                unsafe { (nc.reduce_scatter)(sp as P, rp as P, counts[0], dt, rop, c, s) }
            },
            |nc, c, s, root, off, cnt| {
                let src = sp + off;
                let dst = if root == me { rp } else { src };
                // SAFETY: reduce of chunk `root` to its owner; non-roots' recvbuff unused.
                unsafe { (nc.reduce)(src as P, dst as P, cnt, dt, rop, root as i32, c, s) }
            },
        )
    }

    fn all_to_all_v(
        &self,
        dtype: DType,
        send: DevicePtr<'_>,
        send_counts: &[usize],
        recv: DevicePtr<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        // The own part goes through NCCL too (a copy inside the group's kernel, overlapping
        // the transfers), as in a raw grouped all-to-all.
        grouped_all_to_all(
            self,
            "all_to_all_v",
            true,
            dtype,
            send,
            send_counts,
            recv,
            recv_counts,
        )
    }

    fn all_to_all_v_others(
        &self,
        dtype: DType,
        send: DevicePtr<'_>,
        send_counts: &[usize],
        recv: DevicePtr<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let op = "all_to_all_v_others";
        grouped_all_to_all(self, op, false, dtype, send, send_counts, recv, recv_counts)
    }

    fn broadcast(&self, dtype: DType, buf: DevicePtr<'_>, root: usize) -> Result<(), CommError> {
        let p = buf.ptr;
        let n = buf.bytes / dtype.size();
        launch(
            &self.inner,
            "broadcast",
            &[buf],
            End::Collective,
            |nc, c, s| {
                // SAFETY: in-place broadcast of n elements of a checked buffer.
                unsafe { (nc.broadcast)(p as P, p as P, n, nccl_dtype(dtype), root as i32, c, s) }
            },
        )
    }

    fn reduce(
        &self,
        dtype: DType,
        buf: DevicePtr<'_>,
        n: usize,
        root: usize,
        rop: ReduceOp,
    ) -> Result<(), CommError> {
        let p = buf.ptr;
        let (dt, rop) = (nccl_dtype(dtype), nccl_op(rop));
        launch(
            &self.inner,
            "reduce",
            &[buf],
            End::Collective,
            |nc, c, s| {
                // SAFETY: in-place reduce of n elements of a checked buffer.
                unsafe { (nc.reduce)(p as P, p as P, n, dt, rop, root as i32, c, s) }
            },
        )
    }

    fn send(&self, dtype: DType, buf: DevicePtr<'_>, peer: usize) -> Result<(), CommError> {
        point_to_point(&self.inner, Way::Send, dtype, buf, peer)
    }

    fn recv(&self, dtype: DType, buf: DevicePtr<'_>, peer: usize) -> Result<(), CommError> {
        point_to_point(&self.inner, Way::Recv, dtype, buf, peer)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let i = &*self.inner;
        let ptr = {
            let mut g = lock(&i.scratch);
            if g.is_none() {
                let s = i
                    .comm_stream
                    .alloc_zeros::<f32>(1)
                    .map_err(|e| dev_err("barrier", e))?;
                *g = Some(s);
            }
            match g.as_ref() {
                Some(s) => s.device_ptr(&i.comm_stream).0,
                None => return Err(CommError::Device("barrier: no scratch buffer".into())),
            }
        };
        let saved = *lock(&i.completion);
        *lock(&i.completion) = Completion::Blocking;
        let r = i.run("barrier", None, End::Collective, |nc, c, s| {
            // SAFETY: all-reduce of one element of the comm's scratch buffer.
            nc.check("barrier", c, unsafe {
                (nc.all_reduce)(ptr as P, ptr as P, 1, nccl_dtype(DType::F32), 0, c, s)
            })
        });
        *lock(&i.completion) = saved;
        r
    }

    /// A two-member NCCL communicator of its own (its own comm stream), opened by both members
    /// at their first call for the pair.
    fn one_way(&self, from: usize, to: usize, me: usize) -> Result<SharedComm, CommError> {
        let i = &*self.inner;
        if let Some(c) = lock(&i.channels).get(&(from, to)) {
            return Ok(c.clone());
        }
        let world = vec![i.world_ranks[from], i.world_ranks[to]];
        let key = format!("{}/one_way[{}->{}]", i.key, world[0], world[1]);
        let shared = open(i, key, me, world)?;
        lock(&i.channels).insert((from, to), shared.clone());
        Ok(shared)
    }

    fn sub_group(&self, members: &[usize], me: usize) -> Result<SharedComm, CommError> {
        let i = &*self.inner;
        if let Some((_, c)) = lock(&i.subs).iter().find(|(m, _)| m == members) {
            return Ok(c.clone());
        }
        let world: Vec<usize> = members.iter().map(|&m| i.world_ranks[m]).collect();
        let key = format!(
            "{}/sub[{}]",
            i.key,
            world
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let shared = open(i, key, me, world)?;
        lock(&i.subs).push((members.to_vec(), shared.clone()));
        Ok(shared)
    }
}
