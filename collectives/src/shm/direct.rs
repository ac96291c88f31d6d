//! Single-copy collectives through cross-memory attach: a writer posts the address of its
//! piece (in slot metadata, no payload) and readers copy straight from the writer's buffer
//! into theirs with process_vm_readv; the writer returns only once every reader acknowledged,
//! so its buffer is never read after the call. A writer whose call fails after posting
//! withdraws the post before returning, and readers check after copying that the post is still
//! there, so a copy that may overlap the writer's buffer being freed is never taken as data.
//! Used for bulk all-gather and all-to-all (whose writers of strided pieces with short runs
//! stage them through their slots instead).

use std::sync::atomic::Ordering;

use super::call::Call;
use super::ops::{rounds, sub, win};
use super::segment::cma_read_runs;
use crate::strided::Runs;
use crate::CommError;

/// Strided pieces with runs shorter than this (bytes) are staged through the slots: one iovec
/// per run costs more than copying the run twice.
const DIRECT_MIN_RUN: usize = 64 << 10;

/// The post word of a withdrawn post (no tag hashes to it).
const WITHDRAWN: u64 = 0;

impl Call<'_> {
    /// Copies member k's piece at `addr` (posted as round 0 in its slot 0; runs of `run`
    /// bytes, `stride` apart) into `dst`.
    fn read_from(
        &self,
        k: usize,
        addr: u64,
        run: usize,
        stride: usize,
        dst: &mut [u8],
    ) -> Result<(), CommError> {
        let seg = self.seg(k)?;
        let (pid, _) = seg.owner();
        cma_read_runs(pid, addr, run, stride, dst).map_err(|e| CommError::PeerLost {
            op: self.name.clone(),
            rank: self.ranks[k],
            detail: format!("reading {} bytes of its memory failed: {e}", dst.len()),
        })?;
        // The copy is complete; if the post is still up, the writer had not given up (and its
        // buffer was live) while it ran.
        std::sync::atomic::fence(Ordering::SeqCst);
        if seg.post(0).load(Ordering::Acquire) != self.word(0, 0) {
            return Err(CommError::PeerLost {
                op: self.name.clone(),
                rank: self.ranks[k],
                detail: "it withdrew its buffer (its call failed) while this member copied it"
                    .into(),
            });
        }
        Ok(())
    }

    /// Runs `body` (the part after this member's post); on failure withdraws the post and
    /// returns only then, so no reader takes bytes of a buffer the caller is about to free.
    fn or_withdraw(
        &mut self,
        body: impl FnOnce(&mut Self) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let r = body(self);
        if r.is_err() {
            if let Ok(own) = self.seg(self.me) {
                own.post(0).store(WITHDRAWN, Ordering::SeqCst);
            }
        }
        r
    }

    /// All-gather: `chunks[k]` (already holding this member's own) receives member k's chunk.
    pub fn all_gather_direct(&mut self, chunks: &mut [&mut [u8]]) -> Result<(), CommError> {
        let me = self.me;
        let peers: Vec<usize> = (0..self.n()).filter(|&k| k != me).collect();
        self.acquire(0)?;
        let own = self.seg(me)?;
        own.meta(0, 0)
            .store(chunks[me].len() as u64, Ordering::Relaxed);
        own.meta(0, 1)
            .store(chunks[me].as_ptr() as u64, Ordering::Relaxed);
        let readers: Vec<usize> = if chunks[me].is_empty() {
            Vec::new()
        } else {
            peers.clone()
        };
        self.post(0, 0, 0, &readers)?;
        self.or_withdraw(|c| {
            for &k in &peers {
                if chunks[k].is_empty() {
                    continue;
                }
                let seg = c.wait_post(k, 0, 0, 0)?;
                c.check_meta(seg, 0, k, 0, chunks[k].len())?;
                let addr = seg.meta(0, 1).load(Ordering::Relaxed);
                let len = chunks[k].len();
                c.read_from(k, addr, len, len, chunks[k])?;
                c.ack(k, 0, c.word(0, 0))?;
            }
            // Our chunk must stay readable until every peer has copied it.
            c.acquire(0)
        })
    }

    /// All-to-all: `pieces[j]` (runs at a stride in this member's memory) goes to member j,
    /// `chunks[i]` comes from member i. Each writer picks its mode alone and says it in its
    /// round-0 metadata (per member j of slot 0: length, address, run, stride): *direct*
    /// (address non-zero) when its pieces are contiguous or of long runs, which readers copy
    /// with process_vm_readv, one iovec per run; *staged* (address 0) when a piece has short
    /// runs (one iovec each would cost more than a copy), which it copies into its slots in
    /// rounds, as `all_to_all` does, and readers copy out. Everyone runs the same rounds, so
    /// the modes may differ between members and calls.
    pub fn all_to_all_direct(
        &mut self,
        pieces: &[Runs<'_>],
        chunks: &mut [&mut [u8]],
    ) -> Result<(), CommError> {
        let n = self.n();
        let me = self.me;
        let peers: Vec<usize> = (0..n).filter(|&k| k != me).collect();
        let staged = peers.iter().any(|&j| {
            let p = &pieces[j];
            p.run() < p.len() && p.run() < DIRECT_MIN_RUN
        });
        if staged {
            return self.all_to_all_rounds(pieces, chunks, true);
        }
        self.acquire(0)?;
        let own = self.seg(me)?;
        for (j, p) in pieces.iter().enumerate() {
            own.meta(0, j).store(p.len() as u64, Ordering::Relaxed);
            own.meta(0, n + j).store(p.addr(), Ordering::Relaxed);
            own.meta(0, 2 * n + j)
                .store(p.run() as u64, Ordering::Relaxed);
            own.meta(0, 3 * n + j)
                .store(p.stride() as u64, Ordering::Relaxed);
        }
        let readers: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&j| !pieces[j].is_empty())
            .collect();
        self.post(0, 0, 0, &readers)?;
        self.or_withdraw(|c| {
            c.all_to_all_rounds(pieces, chunks, false)?;
            // Our pieces must stay readable until every peer has copied its own.
            c.acquire(0)
        })
    }

    /// The rounds of an all-to-all: this member writes its pieces to its slots round by round
    /// when `staged` (otherwise its round 0 is posted already, direct) and reads every peer's
    /// piece, straight from a direct writer's memory in round 0, from a staged writer's slot
    /// round by round.
    pub(super) fn all_to_all_rounds(
        &mut self,
        pieces: &[Runs<'_>],
        chunks: &mut [&mut [u8]],
        staged: bool,
    ) -> Result<(), CommError> {
        let n = self.n();
        let me = self.me;
        let b = sub(n);
        let peers: Vec<usize> = (0..n).filter(|&k| k != me).collect();
        let most_rounds = |lens: &mut dyn Iterator<Item = usize>| {
            lens.map(|len| rounds(len, b)).max().unwrap_or(0)
        };
        let r_w = match staged {
            true => most_rounds(&mut peers.iter().map(|&j| pieces[j].len())),
            false => 0,
        };
        let r_r = most_rounds(&mut peers.iter().map(|&i| chunks[i].len()));
        let mut direct_from = vec![false; n];
        for r in 0..r_w.max(r_r) {
            let s = r % 2;
            if r < r_w {
                self.acquire(s)?;
                let mut readers = Vec::new();
                for &j in &peers {
                    let w = win(pieces[j].len(), r, b);
                    if !w.is_empty() {
                        self.fill_own_runs(s, j * b, &pieces[j], w)?;
                        readers.push(j);
                    }
                }
                for (j, p) in pieces.iter().enumerate() {
                    self.set_meta(s, j, p.len())?;
                    if r == 0 {
                        // Address 0: staged.
                        self.set_meta(0, n + j, 0)?;
                    }
                }
                self.post(s, r, 0, &readers)?;
            }
            for &i in &peers {
                let len = chunks[i].len();
                if len == 0 || direct_from[i] {
                    continue;
                }
                let w = win(len, r, b);
                if w.is_empty() {
                    continue;
                }
                let seg = self.wait_post(i, s, r, 0)?;
                self.check_meta(seg, s, i, me, len)?;
                if r == 0 {
                    let addr = seg.meta(0, n + me).load(Ordering::Relaxed);
                    if addr != 0 {
                        direct_from[i] = true;
                        let run = seg.meta(0, 2 * n + me).load(Ordering::Relaxed) as usize;
                        let stride = seg.meta(0, 3 * n + me).load(Ordering::Relaxed) as usize;
                        self.read_from(i, addr, run, stride, chunks[i])?;
                        self.ack(i, 0, self.word(0, 0))?;
                        continue;
                    }
                }
                chunks[i][w.clone()]
                    .copy_from_slice(&self.peer_slot(i, s)?[me * b..me * b + w.len()]);
                self.ack(i, s, self.word(r, 0))?;
            }
        }
        Ok(())
    }
}
