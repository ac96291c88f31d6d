//! In-process backend: the ranks of a world are threads of one process. Members publish their
//! buffers in shared slots, meet at timed barriers, and copy/reduce straight out of each
//! other's memory (each member works on its own chunk, so big buffers use every thread).

mod group;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::algorithms::args;
use crate::flight::CommLog;
use crate::hooks::{cached_sub_group, host_hooks, BackendHooks};
use crate::{
    reduce_into, Backend, Buf, BufMut, CommError, DType, ReduceOp, SharedComm, StridedBlock,
};
use group::{Group, Kind, Meet, Raw, RawCounts, Slot};

const BACKEND: Backend = Backend::InProcess;

/// Groups of one world, keyed by their world ranks in member order.
struct WorldShared {
    timeout: Duration,
    groups: Mutex<HashMap<Vec<usize>, Arc<Group>>>,
}

/// Builds the communicators of an in-process world.
pub struct InProcessWorld;

impl InProcessWorld {
    /// One communicator per rank (index = rank), to be moved into the rank threads. Every
    /// blocking wait gives up after `timeout`, naming the ranks that did not arrive.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(n: usize, timeout: Duration) -> Vec<SharedComm> {
        let ranks: Vec<usize> = (0..n).collect();
        let group = Arc::new(Group::new(ranks.clone(), timeout));
        let mut groups = HashMap::new();
        groups.insert(ranks, group.clone());
        let world = Arc::new(WorldShared {
            timeout,
            groups: Mutex::new(groups),
        });
        (0..n)
            .map(|me| {
                Arc::new(InProcessComm::member(world.clone(), group.clone(), me)) as SharedComm
            })
            .collect()
    }
}

/// One member's handle on an in-process group. Use it from one thread at a time.
pub struct InProcessComm {
    world: Arc<WorldShared>,
    group: Arc<Group>,
    me: usize,
    subs: Mutex<HashMap<Vec<usize>, SharedComm>>,
    log: CommLog,
}

/// Balanced split of `count` elements into `n` chunks: (start, len) in bytes of chunk `i`.
fn chunk(count: usize, n: usize, i: usize, sz: usize) -> (usize, usize) {
    let base = count / n;
    let r = count % n;
    let start = i * base + i.min(r);
    let len = base + usize::from(i < r);
    (start * sz, len * sz)
}

fn mismatch(g: &Group, op: &str, detail: String) -> CommError {
    CommError::Mismatch {
        op: g.op_name(op),
        detail,
    }
}

impl InProcessComm {
    fn member(world: Arc<WorldShared>, group: Arc<Group>, me: usize) -> InProcessComm {
        InProcessComm {
            log: CommLog::new(&group.world_ranks),
            world,
            group,
            me,
            subs: Mutex::new(HashMap::new()),
        }
    }

    fn n(&self) -> usize {
        self.group.size()
    }

    /// Publishes `slot`, meets the others, checks that every member called the same thing
    /// (`agree` compares a member's slot with member 0's), runs `body`, and meets again so no
    /// published buffer is released while someone may still read it.
    fn collective(
        &self,
        name: &'static str,
        slot: Slot,
        agree: impl Fn(&Slot, &Slot) -> Option<String>,
        body: impl FnOnce(&[Slot]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let g = &*self.group;
        g.publish(self.me, slot);
        g.barrier(self.me, name, Meet::Enter)?;
        let slots: Vec<Slot> = (0..self.n()).map(|k| g.slot(k)).collect();
        let s0 = &slots[0];
        let mut verdict = Ok(());
        for (k, s) in slots.iter().enumerate().skip(1) {
            let problem = if s.kind != s0.kind {
                Some(format!(
                    "member 0 called {:?}, member {k} called {:?}",
                    s0.kind, s.kind
                ))
            } else if s.dtype != s0.dtype {
                Some(format!(
                    "member 0 uses {}, member {k} uses {}",
                    s0.dtype, s.dtype
                ))
            } else if s.op != s0.op || s.root != s0.root {
                Some(format!(
                    "member 0 uses op {:?} root {}, member {k} uses op {:?} root {}",
                    s0.op, s0.root, s.op, s.root
                ))
            } else {
                agree(s0, s).map(|d| format!("member 0 vs member {k}: {d}"))
            };
            if let Some(p) = problem {
                verdict = Err(mismatch(g, name, p));
                break;
            }
        }
        let res = verdict.and_then(|()| body(&slots));
        g.barrier(self.me, name, Meet::Leave)?;
        res
    }
}

fn same_len(a: &Slot, b: &Slot) -> Option<String> {
    (a.recv.len != b.recv.len)
        .then(|| format!("buffer of {} bytes vs {} bytes", a.recv.len, b.recv.len))
}

fn same_counts(a: &Slot, b: &Slot) -> Option<String> {
    // SAFETY: both owners are inside this collective (between its two barriers), so their
    // count lists are alive and nobody writes them.
    let (x, y) = unsafe { (a.counts.get(), b.counts.get()) };
    (x != y).then(|| format!("counts {x:?} vs {y:?}"))
}

impl BackendHooks for InProcessComm {
    host_hooks!(buffers: BACKEND);
    host_hooks!(all_reduce_into);
    host_hooks!(all_to_all_v_others);
    host_hooks!(all_to_all_v_strided);
    host_hooks!(identity: BACKEND);

    fn all_reduce(
        &self,
        dtype: DType,
        b: &mut [u8],
        count: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "all_reduce";
        let n = self.n();
        if n == 1 {
            return Ok(());
        }
        let mut slot = Slot::new(Kind::AllReduce, dtype);
        slot.op = Some(op);
        slot.recv = Raw::of_mut(b);
        let me = self.me;
        let sz = dtype.size();
        self.collective(name, slot, same_len, |slots| {
            // Phase 1: member `me` reduces chunk `me` into its own buffer.
            let (s, l) = chunk(count, n, me, sz);
            // SAFETY: every member published its buffer and is between the barriers of this
            // collective; chunk `me` of every buffer is touched only by member `me` in this phase.
            unsafe { reduce_chunk_into(slots, me, s, l, dtype, op) };
            self.group.barrier(me, name, Meet::Middle)?;
            // Phase 2: copy every other member's finished chunk.
            for (k, other) in slots.iter().enumerate() {
                if k != me {
                    let (s, l) = chunk(count, n, k, sz);
                    // SAFETY: both owners are inside this collective; chunk k of member k is
                    // final and only read now, and chunk k of my buffer is written only by me.
                    unsafe {
                        slots[me]
                            .recv
                            .slice_mut(s, l)
                            .copy_from_slice(other.recv.slice(s, l))
                    };
                }
            }
            Ok(())
        })
    }

    fn all_gather_v(
        &self,
        dtype: DType,
        s: &[u8],
        r: &mut [u8],
        counts: &[usize],
        _total: usize,
    ) -> Result<(), CommError> {
        let name = "all_gather_v";
        if self.n() == 1 {
            r.copy_from_slice(s);
            return Ok(());
        }
        let slot = Slot::pieces(Kind::AllGatherV, dtype, s, counts);
        let me = self.me;
        self.collective(name, slot, same_counts, |slots| {
            for (k, (off, len)) in args::byte_offsets(counts, dtype).enumerate() {
                let src = if k == me {
                    s
                } else {
                    // SAFETY: member k is inside this collective and only reads its send
                    // buffer, which holds `counts[k]` elements (checked at its boundary).
                    unsafe { slots[k].send.slice(0, len) }
                };
                r[off..off + len].copy_from_slice(src);
            }
            Ok(())
        })
    }

    fn reduce_scatter_v(
        &self,
        dtype: DType,
        s: &[u8],
        r: &mut [u8],
        counts: &[usize],
        _total: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "reduce_scatter_v";
        if self.n() == 1 {
            r.copy_from_slice(s);
            return Ok(());
        }
        let mut slot = Slot::pieces(Kind::ReduceScatterV, dtype, s, counts);
        slot.op = Some(op);
        let me = self.me;
        self.collective(name, slot, same_counts, |slots| {
            let (off, len) = args::byte_offsets(counts, dtype).nth(me).unwrap_or((0, 0));
            r.copy_from_slice(&s[off..off + len]);
            for (k, other) in slots.iter().enumerate() {
                if k != me {
                    // SAFETY: member k is inside this collective, its send buffer holds the
                    // same counts (agreed above) and is only read.
                    reduce_into(dtype, r, unsafe { other.send.slice(off, len) }, op);
                }
            }
            Ok(())
        })
    }

    fn all_to_all_v(
        &self,
        dtype: DType,
        s: &[u8],
        send_counts: &[usize],
        r: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let name = "all_to_all_v";
        if self.n() == 1 {
            r.copy_from_slice(s);
            return Ok(());
        }
        let mut slot = Slot::pieces(Kind::AllToAllV, dtype, s, send_counts);
        slot.counts2 = RawCounts::of(recv_counts);
        let me = self.me;
        let sz = dtype.size();
        let g = self.group.clone();
        self.collective(
            name,
            slot,
            |_, _| None,
            |slots| {
                // Every member checks every pair, so all reach the same verdict.
                for (i, si) in slots.iter().enumerate() {
                    // SAFETY: every member is inside this collective; count lists are read only.
                    let sc = unsafe { si.counts.get() };
                    for (j, sj) in slots.iter().enumerate() {
                        // SAFETY: as above.
                        let rc = unsafe { sj.counts2.get() };
                        if sc[j] != rc[i] {
                            return Err(mismatch(
                                &g,
                                name,
                                format!(
                                    "member {i} sends {} elements to member {j}, which expects {}",
                                    sc[j], rc[i]
                                ),
                            ));
                        }
                    }
                }
                for (k, (off, len)) in args::byte_offsets(recv_counts, dtype).enumerate() {
                    // SAFETY: member k is inside this collective; its count list is read only.
                    let kc = unsafe { slots[k].counts.get() };
                    let src_off: usize = kc[..me].iter().sum::<usize>() * sz;
                    let src = if k == me {
                        &s[src_off..src_off + len]
                    } else {
                        // SAFETY: member k's send buffer holds its checked counts, which agree
                        // with ours (verified above), and is only read.
                        unsafe { slots[k].send.slice(src_off, len) }
                    };
                    r[off..off + len].copy_from_slice(src);
                }
                Ok(())
            },
        )
    }

    fn broadcast(&self, dtype: DType, b: &mut [u8], root: usize) -> Result<(), CommError> {
        let name = "broadcast";
        if self.n() == 1 {
            return Ok(());
        }
        let mut slot = Slot::new(Kind::Broadcast, dtype);
        slot.root = root;
        slot.recv = Raw::of_mut(b);
        let me = self.me;
        self.collective(name, slot, same_len, |slots| {
            if me != root {
                let len = slots[me].recv.len;
                // SAFETY: both owners are inside this collective; the root's buffer is only
                // read during this phase and mine is written only by me.
                unsafe {
                    slots[me]
                        .recv
                        .slice_mut(0, len)
                        .copy_from_slice(slots[root].recv.slice(0, len))
                };
            }
            Ok(())
        })
    }

    fn reduce(
        &self,
        dtype: DType,
        b: &mut [u8],
        count: usize,
        root: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "reduce";
        let n = self.n();
        if n == 1 {
            return Ok(());
        }
        let mut slot = Slot::new(Kind::Reduce, dtype);
        slot.root = root;
        slot.op = Some(op);
        slot.recv = Raw::of_mut(b);
        let me = self.me;
        let sz = dtype.size();
        self.collective(name, slot, same_len, |slots| {
            // Member `me` reduces chunk `me` into the root's buffer; the others stay unchanged.
            let (s, l) = chunk(count, n, me, sz);
            // SAFETY: every member is inside this collective; chunk `me` of the root's buffer
            // is written only by member `me` here, and the other buffers are only read.
            unsafe { reduce_chunk_into(slots, root, s, l, dtype, op) };
            Ok(())
        })
    }

    fn send(&self, _dtype: DType, b: &[u8], peer: usize) -> Result<(), CommError> {
        self.group.post(self.me, peer, b);
        Ok(())
    }

    fn recv(&self, _dtype: DType, b: &mut [u8], peer: usize) -> Result<(), CommError> {
        self.group.take(peer, self.me, b, "recv")
    }

    fn barrier(&self) -> Result<(), CommError> {
        if self.n() == 1 {
            return Ok(());
        }
        self.collective(
            "barrier",
            Slot::new(Kind::Barrier, DType::F32),
            |_, _| None,
            |_| Ok(()),
        )
    }

    fn sub_group(&self, members: &[usize], me: usize) -> Result<SharedComm, CommError> {
        cached_sub_group(&self.subs, members, &self.group.world_ranks, |ranks| {
            let group = {
                let mut groups = self.world.groups.lock().unwrap_or_else(|e| e.into_inner());
                groups
                    .entry(ranks.clone())
                    .or_insert_with(|| Arc::new(Group::new(ranks, self.world.timeout)))
                    .clone()
            };
            Ok(Arc::new(InProcessComm::member(
                self.world.clone(),
                group,
                me,
            )))
        })
    }
}

/// Reduces bytes `[start, start + len)` of every other member's receive buffer into the same
/// range of member `target`'s receive buffer, in member order.
///
/// # Safety
/// Every slot's receive buffer must be published for the current collective, and no other
/// member may touch that range of any buffer while this runs.
unsafe fn reduce_chunk_into(
    slots: &[Slot],
    target: usize,
    start: usize,
    len: usize,
    dtype: DType,
    op: ReduceOp,
) {
    // SAFETY: the caller guarantees the published buffers are alive and that this range of
    // the target's buffer is written by nobody else.
    let acc = unsafe { slots[target].recv.slice_mut(start, len) };
    for (k, other) in slots.iter().enumerate() {
        if k != target {
            // SAFETY: as above; the others' ranges are only read while this runs.
            reduce_into(dtype, acc, unsafe { other.recv.slice(start, len) }, op);
        }
    }
}
