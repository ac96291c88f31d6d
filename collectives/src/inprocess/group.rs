//! Shared state of one in-process group: a timed barrier that names missing members, the
//! per-member slots through which ranks publish their buffers, and point-to-point mailboxes.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{CommError, DType, ReduceOp};

/// Which collective a member is in (checked across members before any data moves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce,
    AllGatherV,
    ReduceScatterV,
    AllToAllV,
    Broadcast,
    Reduce,
    Barrier,
}

/// A borrowed byte range of some member, published for the duration of one collective.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Raw {
    pub ptr: *mut u8,
    pub len: usize,
}

/// A borrowed count list of some member.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawCounts {
    pub ptr: *const usize,
    pub len: usize,
}

impl Raw {
    pub const EMPTY: Raw = Raw {
        ptr: std::ptr::null_mut(),
        len: 0,
    };
    /// A range this member only reads from (send buffers); never written through.
    pub fn of(b: &[u8]) -> Self {
        Raw {
            ptr: b.as_ptr() as *mut u8,
            len: b.len(),
        }
    }
    /// A range this member lets the group write (receive buffers).
    pub fn of_mut(b: &mut [u8]) -> Self {
        Raw {
            ptr: b.as_mut_ptr(),
            len: b.len(),
        }
    }
    /// The bytes `[start, start + len)`, borrowed for as long as this handle is.
    ///
    /// # Safety
    /// The owner must still be inside the collective that published the range (so the memory
    /// is alive) and stay there while the returned slice is used, `start + len` must lie within
    /// the published `len`, and nobody may write the range at the same time.
    pub unsafe fn slice(&self, start: usize, len: usize) -> &[u8] {
        if len == 0 {
            return &[];
        }
        // SAFETY: the caller guarantees the range lies inside the live, published buffer and
        // is not written concurrently; the result cannot outlive `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.add(start), len) }
    }
    /// The bytes `[start, start + len)` for writing, borrowed for as long as this handle is.
    ///
    /// # Safety
    /// As `slice`, and nobody else may read or write the range while the result is used (the
    /// collectives give each member its own chunk), and the range was published writable
    /// (`of_mut`).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, start: usize, len: usize) -> &mut [u8] {
        if len == 0 {
            return &mut [];
        }
        // SAFETY: the caller guarantees exclusive access to this in-bounds range of a live
        // buffer published through `of_mut`; the result cannot outlive `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

impl RawCounts {
    pub const EMPTY: RawCounts = RawCounts {
        ptr: std::ptr::null(),
        len: 0,
    };
    pub fn of(c: &[usize]) -> Self {
        RawCounts {
            ptr: c.as_ptr(),
            len: c.len(),
        }
    }
    /// The published counts, borrowed for as long as this handle is.
    ///
    /// # Safety
    /// The owner must still be inside the collective that published them and stay there while
    /// the result is used.
    pub unsafe fn get(&self) -> &[usize] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller guarantees the owner's count list is alive; it is never written
        // while published, and the result cannot outlive `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// What one member publishes when it enters a collective.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot {
    pub kind: Kind,
    pub dtype: DType,
    pub op: Option<ReduceOp>,
    pub root: usize,
    pub send: Raw,
    pub recv: Raw,
    pub counts: RawCounts,
    pub counts2: RawCounts,
}

// SAFETY: the raw pointers in a slot are only dereferenced between the barriers that bracket the
// collective that published them, while the publishing thread is blocked inside that collective.
unsafe impl Send for Slot {}

impl Slot {
    pub fn new(kind: Kind, dtype: DType) -> Self {
        Slot {
            kind,
            dtype,
            op: None,
            root: 0,
            send: Raw::EMPTY,
            recv: Raw::EMPTY,
            counts: RawCounts::EMPTY,
            counts2: RawCounts::EMPTY,
        }
    }

    /// A slot publishing `send`, which holds pieces of `counts` elements in member order.
    pub fn pieces(kind: Kind, dtype: DType, send: &[u8], counts: &[usize]) -> Self {
        Slot {
            send: Raw::of(send),
            counts: RawCounts::of(counts),
            ..Slot::new(kind, dtype)
        }
    }
}

struct SyncState {
    arrived: Vec<bool>,
    count: usize,
    generation: u64,
    /// Set when a member timed out: (op, world ranks that were missing). Every later call fails.
    poison: Option<(String, Vec<usize>)>,
    /// Members between the entry and the exit barrier of the current collective: they may
    /// still read the others' published buffers, so nobody leaves with an error before it is 0.
    in_body: usize,
}

/// Which barrier of a collective a member is at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Meet {
    /// Entry: once everyone is here, every member may read the others' buffers.
    Enter,
    /// Between phases of the body.
    Middle,
    /// Exit: this member no longer reads the others' buffers.
    Leave,
}

struct Mailbox {
    queue: Mutex<VecDeque<Vec<u8>>>,
    ready: Condvar,
    spare: Mutex<Vec<Vec<u8>>>,
}

/// State shared by all members of one group (keyed by its world ranks in member order).
pub(crate) struct Group {
    pub world_ranks: Vec<usize>,
    pub timeout: Duration,
    sync: Mutex<SyncState>,
    cv: Condvar,
    slots: Vec<Mutex<Slot>>,
    mail: Vec<Mailbox>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another rank thread panicked; the state stays consistent
    // because every critical section here is panic-free.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Group {
    pub fn new(world_ranks: Vec<usize>, timeout: Duration) -> Self {
        let n = world_ranks.len();
        Group {
            sync: Mutex::new(SyncState {
                arrived: vec![false; n],
                count: 0,
                generation: 0,
                poison: None,
                in_body: 0,
            }),
            cv: Condvar::new(),
            slots: (0..n)
                .map(|_| Mutex::new(Slot::new(Kind::Barrier, DType::F32)))
                .collect(),
            mail: (0..n * n)
                .map(|_| Mailbox {
                    queue: Mutex::new(VecDeque::new()),
                    ready: Condvar::new(),
                    spare: Mutex::new(Vec::new()),
                })
                .collect(),
            world_ranks,
            timeout,
        }
    }

    pub fn size(&self) -> usize {
        self.world_ranks.len()
    }

    pub fn op_name(&self, op: &str) -> String {
        format!("{op} on ranks {:?}", self.world_ranks)
    }

    pub fn publish(&self, me: usize, slot: Slot) {
        *lock(&self.slots[me]) = slot;
    }

    pub fn slot(&self, member: usize) -> Slot {
        *lock(&self.slots[member])
    }

    /// Waits until every member arrived, at most the group's timeout from now. On timeout the
    /// group is poisoned and every member (now and later) fails naming the missing ranks.
    /// `at` says which barrier of a collective this is: a member that fails at the `Leave`
    /// barrier returns only once no member is still inside the body (a straggler may be reading
    /// this member's buffer; bodies never block, so that wait ends). A failure at a `Middle`
    /// barrier ends the body, and the member then fails at `Leave`.
    pub fn barrier(&self, me: usize, op: &str, at: Meet) -> Result<(), CommError> {
        let mut st = lock(&self.sync);
        if at == Meet::Leave {
            st.in_body = st.in_body.saturating_sub(1);
            if st.in_body == 0 {
                self.cv.notify_all();
            }
        }
        let n = self.size();
        let fail = |st: MutexGuard<'_, SyncState>, e: CommError| -> Result<(), CommError> {
            if at == Meet::Leave {
                self.drain(st);
            }
            Err(e)
        };
        // The timeout of a poisoned group: `why` says how this member met the poison.
        let poisoned = |why: &str, pop: &str, missing: &[usize]| CommError::Timeout {
            op: format!("{} ({why} in {pop})", self.op_name(op)),
            timeout: self.timeout,
            missing: missing.to_vec(),
        };
        if let Some((pop, missing)) = &st.poison {
            let e = poisoned("group broken earlier", pop, missing);
            return fail(st, e);
        }
        st.arrived[me] = true;
        st.count += 1;
        if st.count == n {
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.count = 0;
            st.generation = st.generation.wrapping_add(1);
            if at == Meet::Enter {
                st.in_body = n;
            }
            drop(st);
            self.cv.notify_all();
            return Ok(());
        }
        let gen = st.generation;
        let deadline = Instant::now() + self.timeout;
        loop {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..n)
                    .filter(|&m| !st.arrived[m])
                    .map(|m| self.world_ranks[m])
                    .collect();
                st.arrived[me] = false;
                st.count -= 1;
                st.poison = Some((op.to_string(), missing.clone()));
                self.cv.notify_all();
                let e = CommError::Timeout {
                    op: self.op_name(op),
                    timeout: self.timeout,
                    missing,
                };
                return fail(st, e);
            }
            let (g, _) = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner());
            st = g;
            if st.generation != gen {
                return Ok(());
            }
            if let Some((pop, missing)) = &st.poison {
                let e = poisoned("member timed out", pop, missing);
                return fail(st, e);
            }
        }
    }

    /// Waits (the group being poisoned) until no member is inside a collective's body any more,
    /// so buffers this member published are no longer read once it returns.
    fn drain(&self, mut st: MutexGuard<'_, SyncState>) {
        // Not bounded by the timeout on purpose: returning earlier would free memory a
        // straggler still reads. Bodies only copy and reduce (they never block), so the
        // stragglers get here once scheduled; a member failing in a body also counts down.
        while st.in_body > 0 {
            let (g, _) = self
                .cv
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner());
            st = g;
        }
    }

    /// Buffered send: copies `data` into the (src -> dst) mailbox and returns.
    pub fn post(&self, src: usize, dst: usize, data: &[u8]) {
        let mb = &self.mail[src * self.size() + dst];
        let mut v = lock(&mb.spare).pop().unwrap_or_default();
        v.clear();
        v.extend_from_slice(data);
        lock(&mb.queue).push_back(v);
        mb.ready.notify_all();
    }

    /// Takes the next message of (src -> dst) into `out`, waiting at most the timeout.
    pub fn take(&self, src: usize, dst: usize, out: &mut [u8], op: &str) -> Result<(), CommError> {
        let mb = &self.mail[src * self.size() + dst];
        let deadline = Instant::now() + self.timeout;
        let mut q = lock(&mb.queue);
        let msg = loop {
            if let Some(m) = q.pop_front() {
                break m;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: self.op_name(op),
                    timeout: self.timeout,
                    missing: vec![self.world_ranks[src]],
                });
            }
            let (g, _) = mb
                .ready
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|e| e.into_inner());
            q = g;
        };
        drop(q);
        let res = if msg.len() == out.len() {
            out.copy_from_slice(&msg);
            Ok(())
        } else {
            Err(CommError::Mismatch {
                op: self.op_name(op),
                detail: format!(
                    "member {dst} expects {} bytes from member {src}, which sent {} bytes",
                    out.len(),
                    msg.len()
                ),
            })
        };
        let mut spare = lock(&mb.spare);
        if spare.len() < 4 {
            spare.push(msg);
        }
        res
    }
}
