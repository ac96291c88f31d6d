//! The collectives on the shared-memory plane, in rounds over two slots per rank: writers copy
//! once into their own slot, readers reduce or copy straight out of peers' slots into the user
//! buffer. Reductions run in member order, block by block (cache-sized), so every rank gets
//! bitwise-identical results. Large all-reduce is a fused reduce-scatter + all-gather per round.

use std::ops::Range;

use super::call::{Call, SLOT};
use crate::strided::Runs;
use crate::{reduce_into, CommError, DType, ReduceOp};

/// Reduction block: sources and destination stay in L1/L2 while a block is combined.
const BLOCK: usize = 32 << 10;

/// Per-member sub-slot size (64-byte aligned) when a slot is split among `n` members.
pub(super) fn sub(n: usize) -> usize {
    (SLOT / n.max(1)) & !63
}

pub(super) fn win(len: usize, r: usize, b: usize) -> Range<usize> {
    (r * b).min(len)..((r + 1) * b).min(len)
}

pub(super) fn rounds(len: usize, b: usize) -> usize {
    len.div_ceil(b)
}

/// The window of `n` members (`sub(n)` bytes) and the rounds the longest of `lens` takes in it.
fn round_plan(n: usize, lens: &[usize]) -> (usize, usize) {
    let b = sub(n);
    (b, lens.iter().map(|&l| rounds(l, b)).max().unwrap_or(0))
}

/// `out = srcs[0] op srcs[1] op ...` in order, block by block.
fn reduce_members(dtype: DType, op: ReduceOp, out: &mut [u8], srcs: &[&[u8]]) {
    let mut o = 0;
    while o < out.len() {
        let e = (o + BLOCK).min(out.len());
        let blk = &mut out[o..e];
        blk.copy_from_slice(&srcs[0][o..e]);
        for s in &srcs[1..] {
            reduce_into(dtype, blk, &s[o..e], op);
        }
        o = e;
    }
}

impl Call<'_> {
    /// Copies `src` into our slot `s` at byte `off`. Callers hold the slot (`acquire(s)`, and
    /// no post since, or only posts whose readers read other ranges of it).
    fn fill_own(&self, s: usize, off: usize, src: &[u8]) -> Result<(), CommError> {
        let seg = self.seg(self.me)?;
        if off.checked_add(src.len()).is_none_or(|e| e > SLOT) {
            return Err(CommError::InvalidArgument {
                op: self.name.clone(),
                detail: format!("{} bytes at {off} overflow a {SLOT}-byte slot", src.len()),
            });
        }
        // SAFETY: the range is inside our slot `s` (checked above); only this process writes
        // it, and no reader reads it now (see above); `src` is process-private memory, so the
        // ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), seg.data(s).add(off), src.len()) };
        Ok(())
    }

    /// Copies logical bytes `w` of `src` (runs at a stride) into our slot `s` at byte `off`,
    /// under the same rules as `fill_own`.
    pub(super) fn fill_own_runs(
        &self,
        s: usize,
        off: usize,
        src: &Runs<'_>,
        w: Range<usize>,
    ) -> Result<(), CommError> {
        let seg = self.seg(self.me)?;
        if off.checked_add(w.len()).is_none_or(|e| e > SLOT) || w.end > src.len() {
            return Err(CommError::InvalidArgument {
                op: self.name.clone(),
                detail: format!(
                    "bytes {w:?} of a {}-byte piece at {off} overflow a {SLOT}-byte slot",
                    src.len()
                ),
            });
        }
        // SAFETY: the range is inside our slot `s` (checked above); only this process writes
        // it, and no reader reads it now (see `fill_own`); `src` is process-private memory.
        let dst = unsafe { std::slice::from_raw_parts_mut(seg.data(s).add(off), w.len()) };
        src.copy_to(w.start, dst);
        Ok(())
    }

    pub(super) fn peer_slot(&self, k: usize, s: usize) -> Result<&[u8], CommError> {
        let seg = self.seg(k)?;
        // SAFETY: member k's slot `s`, which k does not rewrite before we acknowledge it.
        Ok(unsafe { std::slice::from_raw_parts(seg.data(s), SLOT) })
    }

    fn peers(&self) -> Vec<usize> {
        (0..self.n()).filter(|&k| k != self.me).collect()
    }

    pub(super) fn set_meta(&self, s: usize, j: usize, v: usize) -> Result<(), CommError> {
        self.seg(self.me)?
            .meta(s, j)
            .store(v as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// All-gather: `chunks[k]` (already holding this member's own) receives member k's chunk.
    pub fn all_gather(&mut self, chunks: &mut [&mut [u8]]) -> Result<(), CommError> {
        let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        let r_all = lens.iter().map(|&l| rounds(l, SLOT)).max().unwrap_or(0);
        let peers = self.peers();
        for r in 0..r_all {
            let s = r % 2;
            let w = win(lens[self.me], r, SLOT);
            if !w.is_empty() {
                self.acquire(s)?;
                self.fill_own(s, 0, &chunks[self.me][w.clone()])?;
                self.set_meta(s, 0, lens[self.me])?;
                self.post(s, r, 0, &peers)?;
            }
            for &k in &peers {
                let w = win(lens[k], r, SLOT);
                if w.is_empty() {
                    continue;
                }
                let seg = self.wait_post(k, s, r, 0)?;
                self.check_meta(seg, s, k, 0, lens[k])?;
                chunks[k][w.clone()].copy_from_slice(&self.peer_slot(k, s)?[..w.len()]);
                self.ack(k, s, self.word(r, 0))?;
            }
        }
        Ok(())
    }

    /// Reduce-scatter: `out` receives `op` over every member's `pieces[me]`, in member order.
    pub fn reduce_scatter(
        &mut self,
        dtype: DType,
        op: ReduceOp,
        pieces: &[&[u8]],
        out: &mut [u8],
    ) -> Result<(), CommError> {
        let n = self.n();
        let lens: Vec<usize> = pieces.iter().map(|p| p.len()).collect();
        let (b, r_all) = round_plan(n, &lens);
        let peers = self.peers();
        for r in 0..r_all {
            let s = r % 2;
            self.acquire(s)?;
            let mut readers = Vec::new();
            for &k in &peers {
                let w = win(lens[k], r, b);
                if !w.is_empty() {
                    self.fill_own(s, k * b, &pieces[k][w])?;
                    readers.push(k);
                }
            }
            for (k, &l) in lens.iter().enumerate() {
                self.set_meta(s, k, l)?;
            }
            self.post(s, r, 0, &readers)?;
            let w = win(lens[self.me], r, b);
            if w.is_empty() {
                continue;
            }
            self.wait_posts(&peers, s, r, 0)?;
            let mut srcs: Vec<&[u8]> = Vec::with_capacity(n);
            for (k, piece) in pieces.iter().enumerate() {
                if k == self.me {
                    srcs.push(&piece[w.clone()]);
                } else {
                    let seg = self.seg(k)?;
                    self.check_meta(seg, s, k, self.me, lens[self.me])?;
                    srcs.push(&self.peer_slot(k, s)?[self.me * b..self.me * b + w.len()]);
                }
            }
            reduce_members(dtype, op, &mut out[w], &srcs);
            for &k in &peers {
                self.ack(k, s, self.word(r, 0))?;
            }
        }
        Ok(())
    }

    /// Large all-reduce in place over balanced `chunks`: per round, every member posts its
    /// input windows of the others' chunks; member i reduces its own chunk's window (member
    /// order) into its slot and its buffer, posts it, and copies the others' results.
    pub fn all_reduce(
        &mut self,
        dtype: DType,
        op: ReduceOp,
        chunks: &mut [&mut [u8]],
    ) -> Result<(), CommError> {
        let n = self.n();
        let me = self.me;
        let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        let (b, r_all) = round_plan(n, &lens);
        let peers = self.peers();
        for r in 0..r_all {
            let s = r % 2;
            let mine = win(lens[me], r, b);
            self.acquire(s)?;
            let mut readers = Vec::new();
            for &k in &peers {
                let w = win(lens[k], r, b);
                if !w.is_empty() || !mine.is_empty() {
                    readers.push(k);
                }
                if !w.is_empty() {
                    self.fill_own(s, k * b, &chunks[k][w])?;
                }
            }
            self.post(s, r, 0, &readers)?;
            if !mine.is_empty() {
                self.wait_posts(&peers, s, r, 0)?;
                let own = self.seg(me)?;
                if me * b + mine.len() > SLOT {
                    return Err(CommError::InvalidArgument {
                        op: self.name.clone(),
                        detail: format!("member {me}'s window overflows the slot"),
                    });
                }
                // SAFETY: range `me` of our slot `s` (in bounds, checked above) is written only
                // by this process, and peers read it only after our phase-1 post below; the
                // phase-0 readers read the other members' ranges. Nothing else aliases it here.
                let res: &mut [u8] =
                    unsafe { std::slice::from_raw_parts_mut(own.data(s).add(me * b), mine.len()) };
                {
                    let mut srcs: Vec<&[u8]> = Vec::with_capacity(n);
                    for k in 0..n {
                        if k == me {
                            srcs.push(&chunks[me][mine.clone()]);
                        } else {
                            srcs.push(&self.peer_slot(k, s)?[me * b..me * b + mine.len()]);
                        }
                    }
                    reduce_members(dtype, op, res, &srcs);
                }
                chunks[me][mine.clone()].copy_from_slice(res);
                self.post(s, r, 1, &peers)?;
            }
            for &k in &peers {
                let w = win(lens[k], r, b);
                if !w.is_empty() {
                    self.wait_post(k, s, r, 1)?;
                    let src = &self.peer_slot(k, s)?[k * b..k * b + w.len()];
                    chunks[k][w].copy_from_slice(src);
                    self.ack(k, s, self.word(r, 1))?;
                } else if !mine.is_empty() {
                    self.ack(k, s, self.word(r, 0))?;
                }
            }
        }
        Ok(())
    }

    /// Small all-reduce in place (`buf.len() <= SLOT`): everyone posts its whole buffer, then
    /// reduces all slots (its own included) in member order.
    pub fn all_reduce_small(
        &mut self,
        dtype: DType,
        op: ReduceOp,
        buf: &mut [u8],
    ) -> Result<(), CommError> {
        let peers = self.peers();
        self.acquire(0)?;
        self.fill_own(0, 0, buf)?;
        self.post(0, 0, 0, &peers)?;
        self.wait_posts(&peers, 0, 0, 0)?;
        let mut srcs: Vec<&[u8]> = Vec::with_capacity(self.n());
        for k in 0..self.n() {
            srcs.push(&self.peer_slot(k, 0)?[..buf.len()]);
        }
        reduce_members(dtype, op, buf, &srcs);
        for &k in &peers {
            self.ack(k, 0, self.word(0, 0))?;
        }
        Ok(())
    }

    /// All-to-all: `pieces[j]` (runs at a stride) goes to member j, `chunks[i]` comes from
    /// member i, staged through the slots round by round.
    pub fn all_to_all(
        &mut self,
        pieces: &[Runs<'_>],
        chunks: &mut [&mut [u8]],
    ) -> Result<(), CommError> {
        self.all_to_all_rounds(pieces, chunks, true)
    }

    /// Broadcast of `buf` from member `root`.
    pub fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        let peers = self.peers();
        for r in 0..rounds(buf.len(), SLOT) {
            let s = r % 2;
            let w = win(buf.len(), r, SLOT);
            if self.me == root {
                self.acquire(s)?;
                self.fill_own(s, 0, &buf[w])?;
                self.set_meta(s, 0, buf.len())?;
                self.post(s, r, 0, &peers)?;
            } else {
                let seg = self.wait_post(root, s, r, 0)?;
                self.check_meta(seg, s, root, 0, buf.len())?;
                buf[w.clone()].copy_from_slice(&self.peer_slot(root, s)?[..w.len()]);
                self.ack(root, s, self.word(r, 0))?;
            }
        }
        Ok(())
    }

    /// Reduce to member `root`: its buffer ends with its own values combined with the others'
    /// in member order.
    pub fn reduce(
        &mut self,
        dtype: DType,
        op: ReduceOp,
        buf: &mut [u8],
        root: usize,
    ) -> Result<(), CommError> {
        let peers = self.peers();
        for r in 0..rounds(buf.len(), SLOT) {
            let s = r % 2;
            let w = win(buf.len(), r, SLOT);
            if self.me != root {
                self.acquire(s)?;
                self.fill_own(s, 0, &buf[w])?;
                self.set_meta(s, 0, buf.len())?;
                self.post(s, r, 0, &[root])?;
                continue;
            }
            self.wait_posts(&peers, s, r, 0)?;
            for &k in &peers {
                let seg = self.seg(k)?;
                self.check_meta(seg, s, k, 0, buf.len())?;
            }
            let acc = &mut buf[w.clone()];
            let mut o = 0;
            while o < acc.len() {
                let e = (o + BLOCK).min(acc.len());
                for &k in &peers {
                    reduce_into(dtype, &mut acc[o..e], &self.peer_slot(k, s)?[o..e], op);
                }
                o = e;
            }
            for &k in &peers {
                self.ack(k, s, self.word(r, 0))?;
            }
        }
        Ok(())
    }

    /// Barrier: everyone posts an empty round and waits for everyone else's.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        let peers = self.peers();
        self.acquire(0)?;
        self.post(0, 0, 0, &peers)?;
        self.wait_posts(&peers, 0, 0, 0)?;
        for &k in &peers {
            self.ack(k, 0, self.word(0, 0))?;
        }
        Ok(())
    }
}
