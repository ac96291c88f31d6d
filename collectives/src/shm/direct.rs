//! Single-copy collectives through cross-memory attach: a writer posts the address of its
//! piece (in slot metadata, no payload) and readers copy straight from the writer's buffer
//! into theirs with process_vm_readv; the writer returns only once every reader acknowledged,
//! so its buffer is never read after the call. A writer whose call fails after posting
//! withdraws the post before returning, and readers check after copying that the post is still
//! there, so a copy that may overlap the writer's buffer being freed is never taken as data.
//! Used for bulk all-gather and all-to-all.

use std::sync::atomic::Ordering;

use super::call::Call;
use super::segment::cma_read;
use crate::CommError;

/// The post word of a withdrawn post (no tag hashes to it).
const WITHDRAWN: u64 = 0;

impl Call<'_> {
    /// Copies member k's piece at `addr` (posted as round 0 in its slot 0) into `dst`.
    fn read_from(&self, k: usize, addr: u64, dst: &mut [u8]) -> Result<(), CommError> {
        let seg = self.seg(k)?;
        let (pid, _) = seg.owner();
        cma_read(pid, addr, dst).map_err(|e| CommError::PeerLost {
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
                c.read_from(k, addr, chunks[k])?;
                c.ack(k, 0, c.word(0, 0))?;
            }
            // Our chunk must stay readable until every peer has copied it.
            c.acquire(0)
        })
    }

    /// All-to-all: `pieces[j]` goes to member j, `chunks[i]` comes from member i.
    pub fn all_to_all_direct(
        &mut self,
        pieces: &[&[u8]],
        chunks: &mut [&mut [u8]],
    ) -> Result<(), CommError> {
        let n = self.n();
        let me = self.me;
        let peers: Vec<usize> = (0..n).filter(|&k| k != me).collect();
        self.acquire(0)?;
        let own = self.seg(me)?;
        for (j, p) in pieces.iter().enumerate() {
            own.meta(0, j).store(p.len() as u64, Ordering::Relaxed);
            own.meta(0, n + j)
                .store(p.as_ptr() as u64, Ordering::Relaxed);
        }
        let readers: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&j| !pieces[j].is_empty())
            .collect();
        self.post(0, 0, 0, &readers)?;
        self.or_withdraw(|c| {
            for &i in &peers {
                if chunks[i].is_empty() {
                    continue;
                }
                let seg = c.wait_post(i, 0, 0, 0)?;
                c.check_meta(seg, 0, i, me, chunks[i].len())?;
                let addr = seg.meta(0, n + me).load(Ordering::Relaxed);
                c.read_from(i, addr, chunks[i])?;
                c.ack(i, 0, c.word(0, 0))?;
            }
            // Our pieces must stay readable until every peer has copied its own.
            c.acquire(0)
        })
    }
}
