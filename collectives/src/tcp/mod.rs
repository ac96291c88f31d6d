//! CPU multi-process backend: ranks are processes connected by a full mesh of TCP connections
//! (bootstrapped through the rendezvous store). Collectives use direct exchanges, which on a
//! full mesh move the bandwidth-optimal byte count: all-reduce is reduce-scatter + all-gather
//! (2(n-1)/n of the buffer per rank) above `SMALL_ALL_REDUCE`, one all-to-all-of-everything
//! round below it; every exchange overlaps all sends and receives in one poll loop, and
//! reductions consume bytes as they arrive, in member order (results are bitwise the same on
//! every rank). Sub-groups reuse the world's connections; messages carry (group, sequence).
//! Groups whose members all share this host run through the shared-memory plane (`crate::shm`)
//! instead, unless disabled at connect time; TCP then stays the liveness channel and carries
//! point-to-point messages.

mod all_to_all;
mod engine;
mod launch;
pub(crate) mod mesh;

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::algorithms::args;
use crate::flight::CommLog;
use crate::heartbeat::{self, HeartbeatThread};
use crate::rendezvous::{self, StoreClient, StoreServer};
use crate::shm::{self, Call, OpCode, ShmWorld};
use crate::{reduce_into, Backend, CommError, DType, ReduceOp, SharedComm};
use engine::{Link, Links, RecvOp, SendOp, Tag};
pub use launch::init_world;

/// The TCP data plane's wire decoders, public for the fuzz tests only (not an API).
#[doc(hidden)]
pub mod wire {
    /// Bytes of a frame header, its magic, a hello and the job nonce in it.
    pub const HEADER: usize = super::engine::HEADER;
    pub const MAGIC: u32 = super::engine::MAGIC;
    pub const HELLO: usize = super::mesh::HELLO;
    pub const NONCE: usize = super::mesh::NONCE;

    /// A frame header's fields: (magic, point-to-point, group, sequence, payload length).
    pub fn decode_frame_header(h: &[u8; HEADER]) -> (u32, bool, u64, u64, u64) {
        let (magic, tag, len) = super::engine::parse(h);
        (magic, tag.p2p, tag.group, tag.seq, len)
    }
    /// The header of a message of `len` bytes.
    pub fn encode_frame_header(p2p: bool, group: u64, seq: u64, len: usize) -> [u8; HEADER] {
        super::engine::header(super::engine::Tag { group, seq, p2p }, len)
    }
    /// The rank a bootstrap hello announces, if it belongs to this job and world.
    pub fn decode_hello(h: &[u8; HELLO], nonce: &[u8; NONCE], world: usize) -> Option<usize> {
        super::mesh::check_hello(h, nonce, world)
    }
    pub fn encode_hello(nonce: &[u8; NONCE], rank: usize, world: usize) -> [u8; HELLO] {
        super::mesh::hello(nonce, rank, world)
    }
}

const BACKEND: Backend = Backend::Cpu;
/// How long a rank serving the store keeps it up after the job was refused at the rendezvous,
/// at most, so the other ranks read why instead of finding the store gone.
const REFUSAL_LINGER: Duration = Duration::from_secs(2);
/// All-reduces of at most this many bytes exchange whole buffers in one round.
const SMALL_ALL_REDUCE: usize = 64 << 10;
/// On shared memory, all-reduces of at most this many bytes read every member's whole buffer.
const SHM_SMALL_ALL_REDUCE: usize = 128 << 10;
/// On shared memory with cross-memory attach, all-gathers of at least this many bytes (in
/// total) copy straight from the peers' buffers.
const SHM_DIRECT_MIN: usize = 256 << 10;

/// Per-process state shared by the world and its sub-groups.
struct World {
    links: Mutex<Links>,
    scratch: Mutex<Vec<u8>>,
    timeout: Duration,
    groups: Mutex<HashMap<Vec<usize>, Arc<GroupState>>>,
    /// Segments of the same-host ranks, when shared memory is in use.
    shm: Option<ShmWorld>,
    /// The store this process serves (rank 0 when no launcher does); lives as long as the world.
    _store: Option<StoreServer>,
    /// Writes this rank's progress to the store while the world lives (several ranks only).
    _heartbeat: Option<HeartbeatThread>,
}

impl Drop for World {
    fn drop(&mut self) {
        let t = self.timeout.min(Duration::from_secs(10));
        lock(&self.links).drain(t);
    }
}

/// Sequence counters of one group (shared by every handle on the same ranks).
struct GroupState {
    id: u64,
    seq: AtomicU64,
    p2p_send: Mutex<Vec<u64>>,
    p2p_recv: Mutex<Vec<u64>>,
}

/// This process's member of a TCP group (the world or a sub-group). Calls on one world are
/// serialised; use it from one thread at a time for a meaningful collective order.
pub struct TcpComm {
    world: Arc<World>,
    group: Arc<GroupState>,
    ranks: Vec<usize>,
    me: usize,
    subs: Mutex<HashMap<Vec<usize>, SharedComm>>,
    log: CommLog,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// FNV-1a of the world ranks: the same id on every member, without communication.
fn group_id(ranks: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &r in ranks {
        for b in (r as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn group_state(ranks: &[usize]) -> Arc<GroupState> {
    Arc::new(GroupState {
        id: group_id(ranks),
        seq: AtomicU64::new(0),
        p2p_send: Mutex::new(vec![0; ranks.len()]),
        p2p_recv: Mutex::new(vec![0; ranks.len()]),
    })
}

/// Splits `buf` into consecutive pieces of the given byte lengths.
fn split(mut buf: &mut [u8], lens: impl Iterator<Item = usize>) -> Vec<&mut [u8]> {
    let mut out = Vec::new();
    for l in lens {
        let (a, b) = std::mem::take(&mut buf).split_at_mut(l);
        out.push(a);
        buf = b;
    }
    out
}

/// Splits `buf` into consecutive read-only pieces of the given byte lengths.
fn split_ref(mut buf: &[u8], lens: impl Iterator<Item = usize>) -> Vec<&[u8]> {
    let mut out = Vec::new();
    for l in lens {
        let (a, b) = buf.split_at(l);
        out.push(a);
        buf = b;
    }
    out
}

/// Balanced split of `count` elements into `n` byte lengths.
fn balanced(count: usize, n: usize, sz: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |i| (count / n + usize::from(i < count % n)) * sz)
}

/// Reduces into `acc` the prefixes of `pieces` (in order) that have arrived, each only where
/// every earlier piece is already in, so the order of operations is fixed.
fn ordered_reduce(
    dtype: DType,
    op: ReduceOp,
    acc: &mut [u8],
    recvs: &[RecvOp<'_>],
    done: &mut [usize],
) {
    let sz = dtype.size();
    let mut limit = acc.len();
    for (r, d) in recvs.iter().zip(done.iter_mut()) {
        let f = r.filled();
        let upto = (f.len() / sz * sz).min(limit);
        if upto > *d {
            reduce_into(dtype, &mut acc[*d..upto], &f[*d..upto], op);
            *d = upto;
        }
        limit = *d;
    }
}

fn no_progress(_: &[RecvOp<'_>]) -> Result<(), CommError> {
    Ok(())
}

impl TcpComm {
    /// The tag of the next point-to-point message to or from `peer`: per-direction sequence
    /// numbers (`counters` is the group's send or receive list), so sends and receives pair up
    /// in order.
    fn p2p_tag(&self, counters: &Mutex<Vec<u64>>, peer: usize) -> Tag {
        let mut c = lock(counters);
        let seq = c[peer];
        c[peer] += 1;
        Tag {
            group: self.group.id,
            seq,
            p2p: true,
        }
    }

    /// Builds the TCP world of `world_size` ranks: listens on an ephemeral port of `bind_host`,
    /// publishes it in `store`, connects to every other rank and verifies each connection.
    pub fn connect(
        store: &StoreClient,
        rank: usize,
        world_size: usize,
        bind_host: &str,
        timeout: Duration,
    ) -> Result<SharedComm, CommError> {
        TcpComm::connect_with(store, rank, world_size, bind_host, timeout, true)
    }

    /// As `connect`, choosing whether ranks of this host exchange data through shared memory
    /// (`shm`; every rank of a host should pass the same value, a rank passing false makes its
    /// host-mates reach it over TCP).
    pub fn connect_with(
        store: &StoreClient,
        rank: usize,
        world_size: usize,
        bind_host: &str,
        timeout: Duration,
        shm: bool,
    ) -> Result<SharedComm, CommError> {
        TcpComm::connect_serving(store, rank, world_size, bind_host, timeout, shm, None)
    }

    pub(crate) fn connect_serving(
        store: &StoreClient,
        rank: usize,
        world_size: usize,
        bind_host: &str,
        timeout: Duration,
        shm: bool,
        server: Option<StoreServer>,
    ) -> Result<SharedComm, CommError> {
        args::check_member("tcp connect", "rank", rank, world_size)?;
        if world_size == 1 {
            return Ok(TcpComm::from_streams(
                vec![None],
                rank,
                timeout,
                None,
                server,
                None,
            ));
        }
        let who = format!("pid {} at {bind_host}", std::process::id());
        if let Err(e) = rendezvous::join_world(store, rank, world_size, &who, timeout) {
            if server.is_some() {
                rendezvous::linger_after_refusal(store, world_size, REFUSAL_LINGER);
            }
            return Err(e);
        }
        let (streams, nonce) = mesh::build(store, rank, world_size, bind_host, timeout)?;
        let plane = shm::setup(store, rank, world_size, &nonce, shm, timeout)?;
        let heartbeat = heartbeat::start(store.clone(), rank);
        Ok(TcpComm::from_streams(
            streams, rank, timeout, plane, server, heartbeat,
        ))
    }

    fn from_streams(
        streams: Vec<Option<std::net::TcpStream>>,
        rank: usize,
        timeout: Duration,
        shm: Option<ShmWorld>,
        server: Option<StoreServer>,
        heartbeat: Option<HeartbeatThread>,
    ) -> SharedComm {
        let ranks: Vec<usize> = (0..streams.len()).collect();
        let group = group_state(&ranks);
        let mut groups = HashMap::new();
        groups.insert(ranks.clone(), group.clone());
        let world = Arc::new(World {
            links: Mutex::new(Links {
                links: streams.into_iter().map(|s| s.map(Link::new)).collect(),
                broken: None,
            }),
            scratch: Mutex::new(Vec::new()),
            timeout,
            groups: Mutex::new(groups),
            shm,
            _store: server,
            _heartbeat: heartbeat,
        });
        Arc::new(TcpComm {
            world,
            group,
            log: CommLog::new(&ranks),
            ranks,
            me: rank,
            subs: Mutex::new(HashMap::new()),
        })
    }

    fn name(&self, op: &str) -> String {
        format!("{op} on ranks {:?}", self.ranks)
    }

    /// The sequence number of this group's next collective: every member counts its calls
    /// alike, so the members of one collective get the same number.
    fn next_seq(&self) -> u64 {
        self.group.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn tag(&self, seq: u64, phase: u64) -> Tag {
        Tag {
            group: self.group.id,
            seq: seq * 8 + phase,
            p2p: false,
        }
    }

    /// Runs `f` on the shared-memory plane when every member is on this host (`None`
    /// otherwise). Calls are serialised with the TCP ones; a failure breaks the world as there.
    fn shm_run(
        &self,
        name: &str,
        seq: u64,
        op: OpCode,
        check: &[usize],
        f: impl FnOnce(&mut Call<'_>) -> Result<(), CommError>,
    ) -> Option<Result<(), CommError>> {
        let plane = self.world.shm.as_ref()?;
        if !plane.covers(&self.ranks) {
            return None;
        }
        let mut links = lock(&self.world.links);
        Some(links.guarded(&self.name(name), |links| {
            let fds = links
                .links
                .iter()
                .map(|l| l.as_ref().map(|l| l.stream.as_raw_fd()))
                .collect();
            let mut st = plane.state();
            let mut call = Call::new(
                plane,
                &mut st,
                &self.ranks,
                self.me,
                self.group.id,
                seq,
                op,
                group_id(check),
                self.name(name),
                self.world.timeout,
                fds,
            );
            f(&mut call)
        }))
    }

    fn run(
        &self,
        links: &mut Links,
        name: &str,
        sends: &mut [SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        progress: &mut dyn FnMut(&[RecvOp<'_>]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let op = self.name(name);
        links.guarded(&op, |l| {
            l.run(&op, sends, recvs, self.world.timeout, progress)
        })
    }

    /// The other members' parts, each with its member's world rank: `lo` holds the parts of
    /// the members before this one, `hi` of those after it.
    fn of_peers<'a, I>(&'a self, lo: I, hi: I) -> impl Iterator<Item = (usize, I::Item)> + 'a
    where
        I: IntoIterator + 'a,
    {
        let me = self.me;
        lo.into_iter()
            .enumerate()
            .chain(
                hi.into_iter()
                    .enumerate()
                    .map(move |(i, c)| (i + me + 1, c)),
            )
            .map(|(k, c)| (self.ranks[k], c))
    }

    fn peers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let me = self.me;
        self.ranks
            .iter()
            .copied()
            .enumerate()
            .filter(move |&(k, _)| k != me)
    }

    /// Reduce-scatter of `b` (`count` elements) in place over the balanced chunks of `b` (tag
    /// round 0 of `seq`): returns the chunks, chunk `me` reduced over all members.
    fn reduce_scatter_in_place<'b>(
        &self,
        links: &mut Links,
        name: &str,
        seq: u64,
        (dtype, op): (DType, ReduceOp),
        b: &'b mut [u8],
        count: usize,
    ) -> Result<Vec<&'b mut [u8]>, CommError> {
        let n = self.ranks.len();
        let mut chunks = split(b, balanced(count, n, dtype.size()));
        let tag = self.tag(seq, 0);
        {
            let (lo, rest) = chunks.split_at_mut(self.me);
            let (acc, hi) = rest
                .split_first_mut()
                .ok_or_else(|| CommError::InvalidArgument {
                    op: self.name(name),
                    detail: "member index outside the chunk list".into(),
                })?;
            let mut sends: Vec<SendOp<'_>> = self
                .of_peers(lo.iter(), hi.iter())
                .map(|(r, c)| SendOp::new(r, tag, c))
                .collect();
            self.reduce_from_peers(links, name, tag, (dtype, op), &mut sends, acc)?;
        }
        Ok(chunks)
    }

    /// Sends `sends` (one part per peer) while the peers' parts for this member arrive in the
    /// scratch buffer and reduce into `acc` in member order (the order of operations fixed).
    fn reduce_from_peers(
        &self,
        links: &mut Links,
        name: &str,
        tag: Tag,
        (dtype, op): (DType, ReduceOp),
        sends: &mut [SendOp<'_>],
        acc: &mut [u8],
    ) -> Result<(), CommError> {
        let (n, mine) = (self.ranks.len(), acc.len());
        let mut scratch = lock(&self.world.scratch);
        scratch.resize(mine * (n - 1), 0);
        let mut recvs: Vec<RecvOp<'_>> = self
            .peers()
            .zip(split(&mut scratch[..], std::iter::repeat_n(mine, n - 1)))
            .map(|((_, r), t)| RecvOp::new(r, tag, t))
            .collect();
        let mut done = vec![0usize; n - 1];
        self.run(links, name, sends, &mut recvs, &mut |rs| {
            ordered_reduce(dtype, op, acc, rs, &mut done);
            Ok(())
        })?;
        ordered_reduce(dtype, op, acc, &recvs, &mut done);
        Ok(())
    }

    /// All-gather in place: every member's chunk `k` comes from member k.
    fn all_gather_in_place(
        &self,
        links: &mut Links,
        name: &str,
        tag: Tag,
        chunks: &mut [&mut [u8]],
    ) -> Result<(), CommError> {
        let (lo, rest) = chunks.split_at_mut(self.me);
        let Some((mine, hi)) = rest.split_first_mut() else {
            return Ok(());
        };
        let mine: &[u8] = mine;
        let mut sends: Vec<SendOp<'_>> = self
            .peers()
            .map(|(_, r)| SendOp::new(r, tag, mine))
            .collect();
        let mut recvs: Vec<RecvOp<'_>> = self
            .of_peers(lo.iter_mut(), hi.iter_mut())
            .map(|(r, c)| RecvOp::new(r, tag, c))
            .collect();
        self.run(links, name, &mut sends, &mut recvs, &mut no_progress)
    }
}

mod collectives;
