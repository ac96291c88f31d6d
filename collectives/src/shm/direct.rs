//! Single-copy collectives through cross-memory attach: a writer posts the address of its
//! piece (in slot metadata, no payload) and readers copy straight from the writer's buffer
//! into theirs with process_vm_readv; the writer returns only once every reader acknowledged,
//! so its buffer is never read after the call. Used for bulk all-gather and all-to-all.

use std::sync::atomic::Ordering;

use super::call::Call;
use super::segment::cma_read;
use crate::CommError;

impl Call<'_> {
    fn read_from(&self, k: usize, addr: u64, dst: &mut [u8]) -> Result<(), CommError> {
        let (pid, _) = self.seg(k)?.owner();
        cma_read(pid, addr, dst).map_err(|e| CommError::PeerLost {
            op: self.name.clone(),
            rank: self.ranks[k],
            detail: format!("reading {} bytes of its memory failed: {e}", dst.len()),
        })
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
        for &k in &peers {
            if chunks[k].is_empty() {
                continue;
            }
            let seg = self.wait_post(k, 0, 0, 0)?;
            self.check_meta(seg, 0, k, 0, chunks[k].len())?;
            let addr = seg.meta(0, 1).load(Ordering::Relaxed);
            self.read_from(k, addr, chunks[k])?;
            self.ack(k, 0, self.word(0, 0))?;
        }
        // Our chunk must stay readable until every peer has copied it.
        self.acquire(0)
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
        for &i in &peers {
            if chunks[i].is_empty() {
                continue;
            }
            let seg = self.wait_post(i, 0, 0, 0)?;
            self.check_meta(seg, 0, i, me, chunks[i].len())?;
            let addr = seg.meta(0, n + me).load(Ordering::Relaxed);
            self.read_from(i, addr, chunks[i])?;
            self.ack(i, 0, self.word(0, 0))?;
        }
        self.acquire(0)
    }
}
