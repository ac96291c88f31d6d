//! `Communicator` for `NcclComm`: argument checks, device pointers, and each collective as
//! NCCL calls (grouped send/recv and broadcasts/reduces for uneven counts) on the comm stream.

use super::*;

/// A device pointer checked against this communicator's device and an expected size.
fn dev_ptr(
    op: &str,
    inner: &Inner,
    b: Buf<'_>,
    expected: usize,
    what: &str,
) -> Result<u64, CommError> {
    match b {
        Buf::Host(_) => Err(CommError::Unsupported {
            op: op.into(),
            backend: Backend::Nccl.to_string(),
            detail: format!("{what} is host memory; the NCCL backend takes device buffers"),
        }),
        Buf::Device(d) => {
            if d.device != inner.device {
                return Err(CommError::InvalidArgument {
                    op: op.into(),
                    detail: format!(
                        "{what} lives on device {}, the communicator on device {}",
                        d.device, inner.device
                    ),
                });
            }
            if d.bytes != expected {
                return Err(CommError::BufferSize {
                    op: op.into(),
                    expected,
                    got: d.bytes,
                    detail: what.into(),
                });
            }
            Ok(d.ptr)
        }
    }
}

fn check_counts(op: &str, inner: &Inner, counts: &[usize], what: &str) -> Result<(), CommError> {
    if counts.len() != inner.size {
        return Err(CommError::InvalidArgument {
            op: op.into(),
            detail: format!(
                "{what} has {} entries for {} members",
                counts.len(),
                inner.size
            ),
        });
    }
    Ok(())
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

fn root_check(op: &str, inner: &Inner, root: usize) -> Result<(), CommError> {
    if root >= inner.size {
        return Err(CommError::InvalidArgument {
            op: op.into(),
            detail: format!("root {root} of {} members", inner.size),
        });
    }
    Ok(())
}

type P = *mut std::ffi::c_void;

/// Readies a call's buffers: registers those in `NcclMemory` with the communicator, and
/// returns their fences when every one of them has a fence (see `Inner::run`).
fn prepare<'a>(
    inner: &Arc<Inner>,
    op: &str,
    bufs: &[Buf<'a>],
) -> Result<Option<Vec<&'a dyn crate::DeviceFence>>, CommError> {
    for b in bufs {
        if let Buf::Device(d) = b {
            if d.bytes > 0 {
                memory::ensure_registered(inner, op, d.ptr)?;
            }
        }
    }
    Ok(bufs
        .iter()
        .map(|b| match b {
            Buf::Device(d) => d.fence,
            Buf::Host(_) => None,
        })
        .collect())
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
    send: Buf<'_>,
    send_counts: &[usize],
    recv: BufMut<'_>,
    recv_counts: &[usize],
) -> Result<(), CommError> {
    let i = &*comm.inner;
    check_counts(op, i, send_counts, "send_counts")?;
    check_counts(op, i, recv_counts, "recv_counts")?;
    let me = i.rank;
    crate::algorithms::args::check_own(op, me, send_counts, recv_counts)?;
    let esz = dtype.size();
    // What this member sends to each peer from `send` (nothing to itself without `own`).
    let sent: Vec<usize> = (0..i.size)
        .map(|j| if j == me && !own { 0 } else { send_counts[j] })
        .collect();
    let received: Vec<usize> = (0..i.size)
        .map(|j| if j == me && !own { 0 } else { recv_counts[j] })
        .collect();
    let sp = dev_ptr(op, i, send, sent.iter().sum::<usize>() * esz, "send")?;
    let rp = dev_ptr(
        op,
        i,
        recv.as_buf(),
        recv_counts.iter().sum::<usize>() * esz,
        "recv",
    )?;
    let so = offsets(&sent, esz);
    let ro = offsets(recv_counts, esz);
    let fs = prepare(&comm.inner, op, &[send, recv.as_buf()])?;
    i.run(op, fs.as_deref(), |nc, c, s| {
        i.group(op, || {
            for peer in 0..i.size {
                if sent[peer] > 0 {
                    // SAFETY: send of a checked sub-range.
                    nc.check(op, c, unsafe {
                        (nc.send)(
                            (sp + so[peer] as u64) as P,
                            sent[peer],
                            nccl_dtype(dtype),
                            peer as i32,
                            c,
                            s,
                        )
                    })?;
                }
                if received[peer] > 0 {
                    // SAFETY: recv into a checked sub-range.
                    nc.check(op, c, unsafe {
                        (nc.recv)(
                            (rp + ro[peer] as u64) as P,
                            received[peer],
                            nccl_dtype(dtype),
                            peer as i32,
                            c,
                            s,
                        )
                    })?;
                }
            }
            Ok(())
        })
    })
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.inner.rank
    }
    fn size(&self) -> usize {
        self.inner.size
    }
    fn world_ranks(&self) -> &[usize] {
        &self.inner.world_ranks
    }
    fn backend(&self) -> Backend {
        Backend::Nccl
    }

    fn all_reduce(&self, dtype: DType, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let i = &*self.inner;
        let bytes = buf.len_bytes();
        if !bytes.is_multiple_of(dtype.size()) {
            return Err(CommError::BufferSize {
                op: "all_reduce".into(),
                expected: bytes / dtype.size() * dtype.size(),
                got: bytes,
                detail: format!("not a whole number of {dtype}"),
            });
        }
        let p = dev_ptr("all_reduce", i, buf.as_buf(), bytes, "buffer")?;
        let n = bytes / dtype.size();
        let fs = prepare(&self.inner, "all_reduce", &[buf.as_buf()])?;
        i.run("all_reduce", fs.as_deref(), |nc, c, s| {
            // SAFETY: in-place all-reduce of n elements of a checked device buffer.
            nc.check("all_reduce", c, unsafe {
                (nc.all_reduce)(p as P, p as P, n, nccl_dtype(dtype), nccl_op(op), c, s)
            })
        })
    }

    fn all_reduce_into(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        rop: ReduceOp,
    ) -> Result<(), CommError> {
        let i = &*self.inner;
        let op = "all_reduce_into";
        let bytes = send.len_bytes();
        if !bytes.is_multiple_of(dtype.size()) {
            return Err(CommError::BufferSize {
                op: op.into(),
                expected: bytes / dtype.size() * dtype.size(),
                got: bytes,
                detail: format!("send is not a whole number of {dtype}"),
            });
        }
        let sp = dev_ptr(op, i, send, bytes, "send")?;
        let rp = dev_ptr(op, i, recv.as_buf(), bytes, "recv")?;
        let n = bytes / dtype.size();
        let fs = prepare(&self.inner, op, &[send, recv.as_buf()])?;
        i.run(op, fs.as_deref(), |nc, c, s| {
            // SAFETY: out-of-place all-reduce of n elements between checked buffers.
            nc.check(op, c, unsafe {
                (nc.all_reduce)(sp as P, rp as P, n, nccl_dtype(dtype), nccl_op(rop), c, s)
            })
        })
    }

    fn all_gather_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        counts: &[usize],
    ) -> Result<(), CommError> {
        let i = &*self.inner;
        let op = "all_gather_v";
        check_counts(op, i, counts, "counts")?;
        let esz = dtype.size();
        let total: usize = counts.iter().sum();
        let sp = dev_ptr(op, i, send, counts[i.rank] * esz, "send")?;
        let rp = dev_ptr(op, i, recv.as_buf(), total * esz, "recv")?;
        let equal = counts.iter().all(|&c| c == counts[0]);
        let offs = offsets(counts, esz);
        let fs = prepare(&self.inner, op, &[send, recv.as_buf()])?;
        i.run(op, fs.as_deref(), |nc, c, s| {
            if equal {
                // SAFETY: checked buffers: send counts[0], recv size*counts[0] elements.
                return nc.check(op, c, unsafe {
                    (nc.all_gather)(sp as P, rp as P, counts[0], nccl_dtype(dtype), c, s)
                });
            }
            i.group(op, || {
                for (root, &cnt) in counts.iter().enumerate() {
                    if cnt == 0 {
                        continue;
                    }
                    let dst = rp + offs[root] as u64;
                    let src = if root == i.rank { sp } else { dst };
                    // SAFETY: broadcast of root's piece into its slot of recv.
                    nc.check(op, c, unsafe {
                        (nc.broadcast)(
                            src as P,
                            dst as P,
                            cnt,
                            nccl_dtype(dtype),
                            root as i32,
                            c,
                            s,
                        )
                    })?;
                }
                Ok(())
            })
        })
    }

    fn reduce_scatter_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        recv: BufMut<'_>,
        counts: &[usize],
        rop: ReduceOp,
    ) -> Result<(), CommError> {
        let i = &*self.inner;
        let op = "reduce_scatter_v";
        check_counts(op, i, counts, "counts")?;
        let esz = dtype.size();
        let total: usize = counts.iter().sum();
        let sp = dev_ptr(op, i, send, total * esz, "send")?;
        let rp = dev_ptr(op, i, recv.as_buf(), counts[i.rank] * esz, "recv")?;
        let equal = counts.iter().all(|&c| c == counts[0]);
        let offs = offsets(counts, esz);
        let fs = prepare(&self.inner, op, &[send, recv.as_buf()])?;
        i.run(op, fs.as_deref(), |nc, c, s| {
            if equal {
                // SAFETY: checked buffers.
                return nc.check(op, c, unsafe {
                    (nc.reduce_scatter)(
                        sp as P,
                        rp as P,
                        counts[0],
                        nccl_dtype(dtype),
                        nccl_op(rop),
                        c,
                        s,
                    )
                });
            }
            i.group(op, || {
                for (root, &cnt) in counts.iter().enumerate() {
                    if cnt == 0 {
                        continue;
                    }
                    let src = sp + offs[root] as u64;
                    let dst = if root == i.rank { rp } else { src };
                    // SAFETY: reduce of chunk `root` to its owner; non-roots' recvbuff unused.
                    nc.check(op, c, unsafe {
                        (nc.reduce)(
                            src as P,
                            dst as P,
                            cnt,
                            nccl_dtype(dtype),
                            nccl_op(rop),
                            root as i32,
                            c,
                            s,
                        )
                    })?;
                }
                Ok(())
            })
        })
    }

    fn all_to_all_v(
        &self,
        dtype: DType,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
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
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let op = "all_to_all_v_others";
        grouped_all_to_all(self, op, false, dtype, send, send_counts, recv, recv_counts)
    }

    fn broadcast(&self, dtype: DType, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let i = &*self.inner;
        root_check("broadcast", i, root)?;
        let bytes = buf.len_bytes();
        let p = dev_ptr("broadcast", i, buf.as_buf(), bytes, "buffer")?;
        let n = bytes / dtype.size();
        let fs = prepare(&self.inner, "broadcast", &[buf.as_buf()])?;
        i.run("broadcast", fs.as_deref(), |nc, c, s| {
            // SAFETY: in-place broadcast.
            nc.check("broadcast", c, unsafe {
                (nc.broadcast)(p as P, p as P, n, nccl_dtype(dtype), root as i32, c, s)
            })
        })
    }

    fn reduce(
        &self,
        dtype: DType,
        buf: BufMut<'_>,
        root: usize,
        rop: ReduceOp,
    ) -> Result<(), CommError> {
        let i = &*self.inner;
        root_check("reduce", i, root)?;
        let bytes = buf.len_bytes();
        let p = dev_ptr("reduce", i, buf.as_buf(), bytes, "buffer")?;
        let n = bytes / dtype.size();
        let fs = prepare(&self.inner, "reduce", &[buf.as_buf()])?;
        i.run("reduce", fs.as_deref(), |nc, c, s| {
            // SAFETY: in-place reduce.
            nc.check("reduce", c, unsafe {
                (nc.reduce)(
                    p as P,
                    p as P,
                    n,
                    nccl_dtype(dtype),
                    nccl_op(rop),
                    root as i32,
                    c,
                    s,
                )
            })
        })
    }

    fn send(&self, dtype: DType, buf: Buf<'_>, peer: usize) -> Result<(), CommError> {
        let i = &*self.inner;
        root_check("send", i, peer)?;
        let bytes = buf.len_bytes();
        let p = dev_ptr("send", i, buf, bytes, "buffer")?;
        let fs = prepare(&self.inner, "send", &[buf])?;
        i.run("send", fs.as_deref(), |nc, c, s| {
            // SAFETY: send of a checked buffer.
            nc.check("send", c, unsafe {
                (nc.send)(
                    p as P,
                    bytes / dtype.size(),
                    nccl_dtype(dtype),
                    peer as i32,
                    c,
                    s,
                )
            })
        })
    }

    fn recv(&self, dtype: DType, buf: BufMut<'_>, peer: usize) -> Result<(), CommError> {
        let i = &*self.inner;
        root_check("recv", i, peer)?;
        let bytes = buf.len_bytes();
        let p = dev_ptr("recv", i, buf.as_buf(), bytes, "buffer")?;
        let fs = prepare(&self.inner, "recv", &[buf.as_buf()])?;
        i.run("recv", fs.as_deref(), |nc, c, s| {
            // SAFETY: recv into a checked buffer.
            nc.check("recv", c, unsafe {
                (nc.recv)(
                    p as P,
                    bytes / dtype.size(),
                    nccl_dtype(dtype),
                    peer as i32,
                    c,
                    s,
                )
            })
        })
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
        let r = i.run("barrier", None, |nc, c, s| {
            // SAFETY: all-reduce of one element of the comm's scratch buffer.
            nc.check("barrier", c, unsafe {
                (nc.all_reduce)(ptr as P, ptr as P, 1, nccl_dtype(DType::F32), 0, c, s)
            })
        });
        *lock(&i.completion) = saved;
        r
    }

    fn sub_group(&self, members: &[usize]) -> Result<SharedComm, CommError> {
        let i = &*self.inner;
        let op = "sub_group";
        let mut seen = vec![false; i.size];
        for &m in members {
            if m >= i.size || seen[m] {
                return Err(CommError::InvalidArgument {
                    op: op.into(),
                    detail: format!("members {members:?} must be distinct and < {}", i.size),
                });
            }
            seen[m] = true;
        }
        let Some(me) = members.iter().position(|&m| m == i.rank) else {
            return Err(CommError::InvalidArgument {
                op: op.into(),
                detail: format!("member {} is not in {members:?}", i.rank),
            });
        };
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
        let sub = NcclComm::create(
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
        let shared: SharedComm = Arc::new(sub);
        lock(&i.subs).push((members.to_vec(), shared.clone()));
        Ok(shared)
    }
}
