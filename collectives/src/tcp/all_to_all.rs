//! All-to-all on the CPU backend from contiguous or strided send pieces (`Runs`), never packed
//! on shared memory: with cross-memory attach readers copy contiguous pieces and long runs
//! straight from the writer's buffer, and writers of short runs copy them into their slots in
//! rounds (see `shm::direct`); without it writers copy runs into their slots. Over TCP runs go
//! out by vectored writes; pieces of runs shorter than `MIN_RUN` are packed first.

use super::engine::{RecvOp, SendOp};
use super::{lock, no_progress, split, TcpComm};
use crate::shm::OpCode;
use crate::strided::Runs;
use crate::{CommError, DType};

/// Over TCP, strided pieces with runs shorter than this (bytes) are packed before they are
/// sent (cheaper than one slice each).
const MIN_RUN: usize = 512;

impl TcpComm {
    /// `pieces[j]` goes to member j; `recv` receives `recv_counts[i]` elements from member i,
    /// in member order. Arguments (the piece to itself included) are checked at the boundary.
    pub(super) fn all_to_all_runs(
        &self,
        name: &str,
        dtype: DType,
        pieces: &[Runs<'_>],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let n = self.ranks.len();
        let sz = dtype.size();
        let seq = self.next_seq();
        let mut chunks = split(recv, recv_counts.iter().map(|c| c * sz));
        pieces[self.me].copy_to(0, chunks[self.me]);
        if n == 1 {
            return Ok(());
        }
        if let Some(r) = self.shm_run(name, seq, OpCode::AllToAll, &[dtype as usize], |c| {
            if c.cma() {
                c.all_to_all_direct(pieces, &mut chunks)
            } else {
                c.all_to_all(pieces, &mut chunks)
            }
        }) {
            return r;
        }
        let packed: Vec<Option<Vec<u8>>> = pieces
            .iter()
            .enumerate()
            .map(|(j, p)| {
                (j != self.me && p.run() < p.len() && p.run() < MIN_RUN).then(|| {
                    let mut v = vec![0u8; p.len()];
                    p.copy_to(0, &mut v);
                    v
                })
            })
            .collect();
        let pieces: Vec<Runs<'_>> = pieces
            .iter()
            .zip(&packed)
            .map(|(p, k)| k.as_deref().map_or(*p, Runs::contiguous))
            .collect();
        let tag = self.tag(seq, 0);
        let mut sends: Vec<SendOp<'_>> = self
            .peers()
            .map(|(k, rk)| SendOp::runs(rk, tag, pieces[k]))
            .collect();
        let mut recvs: Vec<RecvOp<'_>> = chunks
            .into_iter()
            .enumerate()
            .filter(|(k, _)| *k != self.me)
            .map(|(k, c)| RecvOp::new(self.ranks[k], tag, c))
            .collect();
        let mut links = lock(&self.world.links);
        self.run(&mut links, name, &mut sends, &mut recvs, &mut no_progress)
    }
}
