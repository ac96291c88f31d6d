//! One collective call on the shared-memory plane: tagged posts into this rank's slots, waits
//! for peers' posts and acknowledgements (spin, yield, then futex sleeps, each wait bounded by
//! the timeout), liveness through the peers' TCP connections, and mismatch detection.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::segment::{Segment, SLOT_BYTES};
use super::{ShmWorld, SlotState};
use crate::CommError;

/// Which collective a post belongs to (part of its tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpCode {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    AllToAll = 4,
    Broadcast = 5,
    Reduce = 6,
    Barrier = 7,
}

const INFO_GROUP: usize = 0;
const INFO_SEQ: usize = 1;
const INFO_OP: usize = 2;
const INFO_ROUND: usize = 3;
const INFO_CHECK: usize = 4;
/// Hash of the other info words, written last: a reader that sees info words of two different
/// posts (the writer being between its stores) sees a seal that does not match and ignores them.
const INFO_SEAL: usize = 5;
/// Info words before the seal.
pub const INFO_WORDS: usize = INFO_SEAL;
const SLEEP: Duration = Duration::from_millis(5);
const LIVENESS_EVERY: Duration = Duration::from_millis(2);

/// Payload bytes of one slot.
pub(crate) const SLOT: usize = SLOT_BYTES;

/// The context of one call: the world's segments, the group and the tag.
pub(crate) struct Call<'a> {
    w: &'a ShmWorld,
    pub st: &'a mut SlotState,
    /// World ranks of the members, in member order.
    pub ranks: &'a [usize],
    /// This process's member index.
    pub me: usize,
    group: u64,
    seq: u64,
    op: OpCode,
    check: u64,
    pub name: String,
    timeout: Duration,
    /// TCP connections by world rank (liveness).
    fds: Vec<Option<RawFd>>,
}

/// Whether a peer's post word `posted` is the awaited post `want` at `phase` or later.
pub fn post_ready(posted: u64, want: u64, phase: u64) -> bool {
    posted & !0xff == want & !0xff && posted & 0xff >= phase
}

/// The info words (group, seq, op, round, check) of a peer's slot when they form one whole
/// post of `group` (`seal` is their hash); None for a torn snapshot or another group's post.
pub fn sealed_info(info: &[u64; INFO_WORDS], seal: u64, group: u64) -> Option<&[u64; INFO_WORDS]> {
    (seal_of(info) == seal && info[INFO_GROUP] == group).then_some(info)
}

/// The seal written after the info words.
pub fn seal_of(info: &[u64; INFO_WORDS]) -> u64 {
    fnv(info)
}

fn fnv(words: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn futex_wait(word: &AtomicU32, expected: u32, t: Duration) {
    let ts = libc::timespec {
        tv_sec: t.as_secs() as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a shared (non-private) futex wait on a 4-aligned word of a live mapping.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: a shared futex wake on a 4-aligned word of a live mapping.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

impl<'a> Call<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        w: &'a ShmWorld,
        st: &'a mut SlotState,
        ranks: &'a [usize],
        me: usize,
        group: u64,
        seq: u64,
        op: OpCode,
        check: u64,
        name: String,
        timeout: Duration,
        fds: Vec<Option<RawFd>>,
    ) -> Call<'a> {
        Call {
            w,
            st,
            ranks,
            me,
            group,
            seq,
            op,
            check,
            name,
            timeout,
            fds,
        }
    }

    /// Whether peers' memory can be read directly (cross-memory attach).
    pub fn cma(&self) -> bool {
        self.w.cma
    }

    pub fn n(&self) -> usize {
        self.ranks.len()
    }

    /// Member `k`'s segment (every member is on this host: checked by `ShmWorld::covers`).
    pub fn seg(&self, k: usize) -> Result<&'a Segment, CommError> {
        let w: &'a ShmWorld = self.w;
        self.ranks
            .get(k)
            .and_then(|&r| w.segs.get(r))
            .and_then(Option::as_ref)
            .ok_or_else(|| CommError::InvalidArgument {
                op: self.name.clone(),
                detail: format!("member {k} has no shared-memory segment"),
            })
    }

    /// The post word of `round` at `phase`: the tag's hash in the high bits (never zero).
    pub fn word(&self, round: usize, phase: u64) -> u64 {
        let h = fnv(&[self.group, self.seq, self.op as u64, round as u64]) & !0xff;
        (if h == 0 { 0x100 } else { h }) | phase
    }

    fn ring(&self, world_rank: usize) {
        if let Some(Some(s)) = self.w.segs.get(world_rank) {
            let (seq, sleepers) = s.doorbell();
            seq.fetch_add(1, Ordering::SeqCst);
            if sleepers.load(Ordering::SeqCst) > 0 {
                futex_wake(seq);
            }
        }
    }

    /// Waits (bounded by the timeout) until every reader of slot `s`'s last post has
    /// acknowledged it, so the slot may be rewritten.
    pub fn acquire(&mut self, s: usize) -> Result<(), CommError> {
        let own = self.seg(self.me)?;
        let want = self.st.last_post[s];
        let readers = self.st.last_readers[s].clone();
        let pending = |r: &usize| own.ack(s, *r).load(Ordering::Acquire) != want;
        self.wait(&mut || Ok(!readers.iter().any(pending)), &|| {
            readers.iter().copied().filter(pending).collect()
        })?;
        self.st.last_readers[s].clear();
        Ok(())
    }

    /// Publishes slot `s` (already written) as `round` at `phase` for `readers` (member
    /// indices), with `meta` words, and wakes them.
    pub fn post(
        &mut self,
        s: usize,
        round: usize,
        phase: u64,
        readers: &[usize],
    ) -> Result<(), CommError> {
        let own = self.seg(self.me)?;
        let info = [
            self.group,
            self.seq,
            self.op as u64,
            round as u64,
            self.check,
        ];
        for (i, v) in info.into_iter().enumerate() {
            own.info(s, i).store(v, Ordering::Relaxed);
        }
        own.info(s, INFO_SEAL).store(fnv(&info), Ordering::Release);
        let word = self.word(round, phase);
        own.post(s).store(word, Ordering::Release);
        self.st.last_post[s] = word;
        for &k in readers {
            let r = self.ranks[k];
            if !self.st.last_readers[s].contains(&r) {
                self.st.last_readers[s].push(r);
            }
        }
        for &k in readers {
            self.ring(self.ranks[k]);
        }
        Ok(())
    }

    /// Waits until member `k` has posted `round` at `phase` (or later) in its slot `s`.
    pub fn wait_post(
        &self,
        k: usize,
        s: usize,
        round: usize,
        phase: u64,
    ) -> Result<&'a Segment, CommError> {
        let seg = self.seg(k)?;
        let want = self.word(round, phase);
        let ready = || post_ready(seg.post(s).load(Ordering::Acquire), want, phase);
        self.wait(
            &mut || {
                if ready() {
                    return Ok(true);
                }
                self.check_mismatch(seg, s, k, round)?;
                Ok(false)
            },
            &|| vec![self.ranks[k]],
        )?;
        Ok(seg)
    }

    /// Waits for `round` at `phase` from every member in `ks`, naming all that are missing.
    pub fn wait_posts(
        &self,
        ks: &[usize],
        s: usize,
        round: usize,
        phase: u64,
    ) -> Result<(), CommError> {
        let want = self.word(round, phase);
        let segs: Vec<&Segment> = ks.iter().map(|&k| self.seg(k)).collect::<Result<_, _>>()?;
        let missing = || -> Vec<usize> {
            ks.iter()
                .zip(&segs)
                .filter(|(_, seg)| !post_ready(seg.post(s).load(Ordering::Acquire), want, phase))
                .map(|(&k, _)| self.ranks[k])
                .collect()
        };
        self.wait(
            &mut || {
                let m = missing();
                for (&k, seg) in ks.iter().zip(&segs) {
                    if m.contains(&self.ranks[k]) {
                        self.check_mismatch(seg, s, k, round)?;
                    }
                }
                Ok(m.is_empty())
            },
            &missing,
        )
    }

    /// Tells member `k` that its slot `s`'s post `word` has been consumed.
    pub fn ack(&self, k: usize, s: usize, word: u64) -> Result<(), CommError> {
        let seg = self.seg(k)?;
        seg.ack(s, self.ranks[self.me])
            .store(word, Ordering::Release);
        self.ring(self.ranks[k]);
        Ok(())
    }

    /// Checks member `k`'s slot `s` metadata word `j` against `expected` bytes.
    pub fn check_meta(
        &self,
        seg: &Segment,
        s: usize,
        k: usize,
        j: usize,
        expected: usize,
    ) -> Result<(), CommError> {
        let got = seg.meta(s, j).load(Ordering::Relaxed);
        if got != expected as u64 {
            return Err(CommError::Mismatch {
                op: self.name.clone(),
                detail: format!(
                    "rank {} sends {got} bytes for member {j}; this member expects {expected}",
                    self.ranks[k]
                ),
            });
        }
        Ok(())
    }

    /// Fails if member `k`'s slot `s` holds a post of this group that cannot precede the one
    /// awaited (a later call, or this call with another op or arguments): the members disagree.
    /// Only a consistent snapshot of the info words counts (see `INFO_SEAL`); a torn one, read
    /// while the writer is between its stores, is ignored (the next check sees it whole).
    fn check_mismatch(
        &self,
        seg: &Segment,
        s: usize,
        k: usize,
        round: usize,
    ) -> Result<(), CommError> {
        let seal = seg.info(s, INFO_SEAL).load(Ordering::Acquire);
        let mut info = [0u64; INFO_WORDS];
        for (i, w) in info.iter_mut().enumerate() {
            *w = seg.info(s, i).load(Ordering::Relaxed);
        }
        let Some(info) = sealed_info(&info, seal, self.group) else {
            return Ok(());
        };
        let (seq, op, check) = (info[INFO_SEQ], info[INFO_OP], info[INFO_CHECK]);
        let bad =
            seq > self.seq || (seq == self.seq && (op != self.op as u64 || check != self.check));
        if bad {
            return Err(CommError::Mismatch {
                op: self.name.clone(),
                detail: format!(
                    "rank {} posted call {seq} (op {op}, check {check:#x}, round {}); this member is in call {} ({:?}, check {:#x}, round {round})",
                    self.ranks[k],
                    info[INFO_ROUND],
                    self.seq,
                    self.op,
                    self.check
                ),
            });
        }
        Ok(())
    }

    /// The members among `ranks` (world ranks) whose TCP connection has closed: their process
    /// exited (after finishing its part, or crashed).
    fn closed(&self, ranks: &[usize]) -> Vec<usize> {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut who = Vec::new();
        for &r in ranks {
            if let Some(Some(fd)) = self.fds.get(r) {
                fds.push(libc::pollfd {
                    fd: *fd,
                    events: libc::POLLRDHUP,
                    revents: 0,
                });
                who.push(r);
            }
        }
        // SAFETY: a valid array of pollfds; zero timeout.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
        if rc <= 0 {
            return Vec::new();
        }
        fds.iter()
            .zip(who)
            .filter(|(f, _)| f.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0)
            .map(|(_, r)| r)
            .collect()
    }

    /// Fails with `PeerLost` if a member this wait still needs something from has exited. A
    /// member that exits after posting (or acknowledging) everything awaited from it has just
    /// finished its part of the job before us: its closed connection is no failure. `ready`
    /// is checked again after the connections, since the member may have posted and exited
    /// between the caller's last check and the poll.
    fn liveness(
        &self,
        ready: &mut dyn FnMut() -> Result<bool, CommError>,
        missing: &dyn Fn() -> Vec<usize>,
    ) -> Result<bool, CommError> {
        let closed = self.closed(&missing());
        if closed.is_empty() {
            return Ok(false);
        }
        // The member's stores into shared memory precede its exit, which precedes the hang-up
        // the poll reported; fence so the re-check below reads them.
        std::sync::atomic::fence(Ordering::SeqCst);
        if ready()? {
            return Ok(true);
        }
        let still = missing();
        match closed.into_iter().find(|r| still.contains(r)) {
            Some(r) => Err(CommError::PeerLost {
                op: self.name.clone(),
                rank: r,
                detail: "connection closed (the process exited or crashed) before it posted \
                         or acknowledged what this member waits for"
                    .into(),
            }),
            None => Ok(false),
        }
    }

    /// Waits until `ready`, spinning briefly, then yielding, then sleeping on this rank's
    /// doorbell; fails after the timeout naming `missing()`, or when a member dies.
    fn wait(
        &self,
        ready: &mut dyn FnMut() -> Result<bool, CommError>,
        missing: &dyn Fn() -> Vec<usize>,
    ) -> Result<(), CommError> {
        if ready()? {
            return Ok(());
        }
        let start = Instant::now();
        let deadline = start + self.timeout;
        let (bell, sleepers) = self.seg(self.me)?.doorbell();
        let mut tries = 0u32;
        let mut checked = start;
        loop {
            tries += 1;
            if tries < 32 {
                std::hint::spin_loop();
            } else if tries < 64 {
                std::thread::yield_now();
            } else {
                sleepers.fetch_add(1, Ordering::SeqCst);
                let v = bell.load(Ordering::SeqCst);
                let r = ready();
                if !matches!(r, Ok(false)) {
                    sleepers.fetch_sub(1, Ordering::SeqCst);
                    return r.map(|_| ());
                }
                let left = deadline.saturating_duration_since(Instant::now());
                futex_wait(bell, v, left.min(SLEEP).max(Duration::from_micros(50)));
                sleepers.fetch_sub(1, Ordering::SeqCst);
            }
            if ready()? {
                return Ok(());
            }
            let now = Instant::now();
            if now.duration_since(checked) >= LIVENESS_EVERY {
                checked = now;
                if self.liveness(ready, missing)? {
                    return Ok(());
                }
            }
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: self.name.clone(),
                    timeout: self.timeout,
                    missing: missing(),
                });
            }
        }
    }
}
