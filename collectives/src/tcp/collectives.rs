//! The backend hooks of the TCP backend: the exchanges (arguments are checked at the boundary).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;

use super::engine::{RecvOp, SendOp};
use super::{
    balanced, group_state, lock, no_progress, split, split_ref, TcpComm, BACKEND, SHM_DIRECT_MIN,
    SHM_SMALL_ALL_REDUCE, SMALL_ALL_REDUCE,
};
use crate::flight::CommLog;
use crate::hooks::{cached_sub_group, host_hooks, BackendHooks};
use crate::shm::OpCode;
use crate::strided::Runs;
use crate::{
    reduce_into, Backend, Buf, BufMut, CommError, DType, ReduceOp, SharedComm, StridedBlock,
};

impl BackendHooks for TcpComm {
    host_hooks!(buffers: BACKEND);
    host_hooks!(all_reduce_into);
    host_hooks!(all_to_all_v_others);
    host_hooks!(identity: BACKEND);

    fn all_reduce(
        &self,
        dtype: DType,
        b: &mut [u8],
        count: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "all_reduce";
        let n = self.ranks.len();
        if n == 1 {
            return Ok(());
        }
        let seq = self.next_seq();
        let check = [b.len(), dtype as usize, op as usize];
        let sz = dtype.size();
        if let Some(r) = self.shm_run(name, seq, OpCode::AllReduce, &check, |c| {
            if b.len() <= SHM_SMALL_ALL_REDUCE || count < n {
                c.all_reduce_small(dtype, op, b)
            } else {
                c.all_reduce(dtype, op, &mut split(b, balanced(count, n, sz)))
            }
        }) {
            return r;
        }
        let mut links = lock(&self.world.links);
        if b.len() <= SMALL_ALL_REDUCE || count < n {
            // One round: everyone sends its whole buffer to everyone, then reduces in member order.
            let mut scratch = lock(&self.world.scratch);
            let len = b.len();
            scratch.resize(len * n, 0);
            let mut slots = split(&mut scratch[..], std::iter::repeat_n(len, n));
            slots[self.me].copy_from_slice(b);
            self.all_gather_in_place(&mut links, name, self.tag(seq, 0), &mut slots)?;
            b.copy_from_slice(slots[0]);
            for s in &slots[1..] {
                reduce_into(dtype, b, s, op);
            }
            return Ok(());
        }
        let mut chunks =
            self.reduce_scatter_in_place(&mut links, name, seq, (dtype, op), b, count)?;
        self.all_gather_in_place(&mut links, name, self.tag(seq, 1), &mut chunks)
    }

    fn all_gather_v(
        &self,
        dtype: DType,
        s: &[u8],
        r: &mut [u8],
        counts: &[usize],
        total: usize,
    ) -> Result<(), CommError> {
        let name = "all_gather_v";
        let n = self.ranks.len();
        let seq = self.next_seq();
        let mut chunks = split(r, counts.iter().map(|c| c * dtype.size()));
        chunks[self.me].copy_from_slice(s);
        if n == 1 {
            return Ok(());
        }
        let check = [total, dtype as usize];
        if let Some(r) = self.shm_run(name, seq, OpCode::AllGather, &check, |c| {
            if c.cma() && total * dtype.size() >= SHM_DIRECT_MIN {
                c.all_gather_direct(&mut chunks)
            } else {
                c.all_gather(&mut chunks)
            }
        }) {
            return r;
        }
        let mut links = lock(&self.world.links);
        self.all_gather_in_place(&mut links, name, self.tag(seq, 0), &mut chunks)
    }

    fn reduce_scatter_v(
        &self,
        dtype: DType,
        s: &[u8],
        r: &mut [u8],
        counts: &[usize],
        total: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "reduce_scatter_v";
        let n = self.ranks.len();
        let seq = self.next_seq();
        let sz = dtype.size();
        let off: usize = counts[..self.me].iter().sum::<usize>() * sz;
        r.copy_from_slice(&s[off..off + r.len()]);
        if n == 1 {
            return Ok(());
        }
        let check = [total, dtype as usize, op as usize];
        if let Some(res) = self.shm_run(name, seq, OpCode::ReduceScatter, &check, |c| {
            let pieces = split_ref(s, counts.iter().map(|c| c * sz));
            c.reduce_scatter(dtype, op, &pieces, r)
        }) {
            return res;
        }
        let tag = self.tag(seq, 0);
        let mut links = lock(&self.world.links);
        let pieces = split_ref(s, counts.iter().map(|c| c * sz));
        let mut sends: Vec<SendOp<'_>> = self
            .peers()
            .map(|(k, rk)| SendOp::new(rk, tag, pieces[k]))
            .collect();
        self.reduce_from_peers(&mut links, name, tag, (dtype, op), &mut sends, r)
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
        let pieces: Vec<Runs<'_>> = split_ref(s, send_counts.iter().map(|c| c * dtype.size()))
            .into_iter()
            .map(Runs::contiguous)
            .collect();
        self.all_to_all_runs(name, dtype, &pieces, r, recv_counts)
    }

    fn all_to_all_v_strided(
        &self,
        dtype: DType,
        s: &[u8],
        send_layout: &[StridedBlock],
        _send_counts: &[usize],
        r: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let name = "all_to_all_v_strided";
        let pieces: Vec<Runs<'_>> = send_layout.iter().map(|b| Runs::of(s, b, dtype)).collect();
        self.all_to_all_runs(name, dtype, &pieces, r, recv_counts)
    }

    fn broadcast(&self, _dtype: DType, b: &mut [u8], root: usize) -> Result<(), CommError> {
        let name = "broadcast";
        if self.ranks.len() == 1 {
            return Ok(());
        }
        let seq = self.next_seq();
        let check = [b.len(), root];
        if let Some(r) = self.shm_run(name, seq, OpCode::Broadcast, &check, |c| {
            c.broadcast(b, root)
        }) {
            return r;
        }
        let tag = self.tag(seq, 0);
        let mut links = lock(&self.world.links);
        if self.me == root {
            let mut sends: Vec<SendOp<'_>> = self
                .peers()
                .map(|(_, rk)| SendOp::new(rk, tag, b))
                .collect();
            self.run(&mut links, name, &mut sends, &mut [], &mut no_progress)
        } else {
            let mut recvs = [RecvOp::new(self.ranks[root], tag, b)];
            self.run(&mut links, name, &mut [], &mut recvs, &mut no_progress)
        }
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
        let n = self.ranks.len();
        if n == 1 {
            return Ok(());
        }
        let seq = self.next_seq();
        let check = [b.len(), root, dtype as usize, op as usize];
        if let Some(r) = self.shm_run(name, seq, OpCode::Reduce, &check, |c| {
            c.reduce(dtype, op, b, root)
        }) {
            return r;
        }
        let mut links = lock(&self.world.links);
        let chunks = self.reduce_scatter_in_place(&mut links, name, seq, (dtype, op), b, count)?;
        // Gather the reduced chunks at the root.
        let tag = self.tag(seq, 1);
        if self.me == root {
            let mut recvs: Vec<RecvOp<'_>> = chunks
                .into_iter()
                .enumerate()
                .filter(|(k, _)| *k != root)
                .map(|(k, c)| RecvOp::new(self.ranks[k], tag, c))
                .collect();
            self.run(&mut links, name, &mut [], &mut recvs, &mut no_progress)
        } else {
            let mut sends = [SendOp::new(self.ranks[root], tag, chunks[self.me])];
            self.run(&mut links, name, &mut sends, &mut [], &mut no_progress)
        }
    }

    fn send(&self, _dtype: DType, b: &[u8], peer: usize) -> Result<(), CommError> {
        let name = "send";
        let tag = self.p2p_tag(&self.group.p2p_send, peer);
        lock(&self.world.links).post(&self.name(name), self.ranks[peer], tag, b)
    }

    fn recv(&self, _dtype: DType, b: &mut [u8], peer: usize) -> Result<(), CommError> {
        let name = "recv";
        let tag = self.p2p_tag(&self.group.p2p_recv, peer);
        let mut recvs = [RecvOp::new(self.ranks[peer], tag, b)];
        let mut links = lock(&self.world.links);
        self.run(&mut links, name, &mut [], &mut recvs, &mut no_progress)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let name = "barrier";
        if self.ranks.len() == 1 {
            return Ok(());
        }
        let seq = self.next_seq();
        if let Some(r) = self.shm_run(name, seq, OpCode::Barrier, &[], |c| c.barrier()) {
            return r;
        }
        let tag = self.tag(seq, 0);
        let mut sink: Vec<[u8; 0]> = vec![[]; self.ranks.len()];
        let mut sends: Vec<SendOp<'_>> = self
            .peers()
            .map(|(_, rk)| SendOp::new(rk, tag, &[]))
            .collect();
        let mut recvs: Vec<RecvOp<'_>> = self
            .peers()
            .zip(sink.iter_mut())
            .map(|((_, rk), s)| RecvOp::new(rk, tag, &mut s[..]))
            .collect();
        let mut links = lock(&self.world.links);
        self.run(&mut links, name, &mut sends, &mut recvs, &mut no_progress)
    }

    fn sub_group(&self, members: &[usize], me: usize) -> Result<SharedComm, CommError> {
        cached_sub_group(&self.subs, members, &self.ranks, |ranks| {
            let group = lock(&self.world.groups)
                .entry(ranks.clone())
                .or_insert_with(|| group_state(&ranks))
                .clone();
            Ok(Arc::new(TcpComm {
                world: self.world.clone(),
                group,
                log: CommLog::new(&ranks),
                ranks,
                me,
                subs: Mutex::new(HashMap::new()),
            }))
        })
    }
}
