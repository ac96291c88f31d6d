//! The TCP data plane's transfer engine: framed messages (header with group id, sequence and
//! length) over non-blocking sockets, driven by one `poll` loop per call so every send and
//! receive of a collective progresses at once, reductions run as bytes arrive, and every wait
//! has a deadline. Dead peers (EOF, reset) and silent ones (deadline) are named in the error.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::strided::Runs;
use crate::CommError;

pub(crate) const HEADER: usize = 32;
/// Most slices one vectored write of a strided message gathers.
const MAX_SLICES: usize = 64;
pub(super) const MAGIC: u32 = 0x4f58_4631; // "OXF1"

/// What a message belongs to: the group (hash of its world ranks), the call's sequence number
/// and phase, and whether it is point-to-point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tag {
    pub group: u64,
    pub seq: u64,
    pub p2p: bool,
}

pub(super) fn header(tag: Tag, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&u32::from(tag.p2p).to_le_bytes());
    h[8..16].copy_from_slice(&tag.group.to_le_bytes());
    h[16..24].copy_from_slice(&tag.seq.to_le_bytes());
    h[24..32].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

pub(super) fn parse(h: &[u8; HEADER]) -> (u32, Tag, u64) {
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(b)
    };
    (
        u32_at(0),
        Tag {
            group: u64_at(8),
            seq: u64_at(16),
            p2p: u32_at(4) == 1,
        },
        u64_at(24),
    )
}

/// One outgoing message of a call: its bytes may be runs at a stride (gathered by vectored
/// writes straight from the caller's buffer).
pub(crate) struct SendOp<'a> {
    peer: usize,
    hdr: [u8; HEADER],
    data: Runs<'a>,
    pos: usize,
}

impl<'a> SendOp<'a> {
    pub fn new(peer: usize, tag: Tag, data: &'a [u8]) -> Self {
        SendOp::runs(peer, tag, Runs::contiguous(data))
    }
    pub fn runs(peer: usize, tag: Tag, data: Runs<'a>) -> Self {
        SendOp {
            peer,
            hdr: header(tag, data.len()),
            data,
            pos: 0,
        }
    }
    fn done(&self) -> bool {
        self.pos == HEADER + self.data.len()
    }
}

/// One incoming message of a call, received straight into `buf`.
pub(crate) struct RecvOp<'a> {
    peer: usize,
    tag: Tag,
    hdr: [u8; HEADER],
    hdr_got: usize,
    buf: &'a mut [u8],
    got: usize,
}

impl<'a> RecvOp<'a> {
    pub fn new(peer: usize, tag: Tag, buf: &'a mut [u8]) -> Self {
        RecvOp {
            peer,
            tag,
            hdr: [0; HEADER],
            hdr_got: 0,
            buf,
            got: 0,
        }
    }
    /// The bytes received so far (a prefix of the message).
    pub fn filled(&self) -> &[u8] {
        &self.buf[..self.got]
    }
    fn done(&self) -> bool {
        self.hdr_got == HEADER && self.got == self.buf.len()
    }
}

/// One connection to a peer, plus bytes of buffered point-to-point sends not yet written.
pub(crate) struct Link {
    pub stream: TcpStream,
    pending: VecDeque<Vec<u8>>,
    pending_pos: usize,
}

impl Link {
    pub fn new(stream: TcpStream) -> Self {
        Link {
            stream,
            pending: VecDeque::new(),
            pending_pos: 0,
        }
    }
}

/// The connections of one process, indexed by world rank (`None` for itself).
pub(crate) struct Links {
    pub links: Vec<Option<Link>>,
    /// Set when a call failed half-way: the streams may be out of step, so later calls fail.
    pub broken: Option<String>,
}

fn lost(op: &str, rank: usize, detail: String) -> CommError {
    CommError::PeerLost {
        op: op.to_string(),
        rank,
        detail,
    }
}

/// Writes buffered sends to `l`; Ok(true) when all went out.
fn flush_pending(l: &mut Link, op: &str, peer: usize) -> Result<bool, CommError> {
    while let Some(front) = l.pending.front() {
        match l.stream.write(&front[l.pending_pos..]) {
            Ok(0) => return Err(lost(op, peer, "connection closed while sending".into())),
            Ok(k) => {
                l.pending_pos += k;
                if l.pending_pos == front.len() {
                    l.pending.pop_front();
                    l.pending_pos = 0;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(lost(op, peer, format!("send failed: {e}"))),
        }
    }
    Ok(true)
}

/// Writes as much of `s` as the socket takes; Ok(progressed).
fn push(l: &mut Link, s: &mut SendOp<'_>, op: &str) -> Result<bool, CommError> {
    let mut progressed = false;
    while !s.done() {
        let mut bufs = [IoSlice::new(&[]); MAX_SLICES];
        let mut k = 0;
        if s.pos < HEADER {
            bufs[0] = IoSlice::new(&s.hdr[s.pos..]);
            k = 1;
        }
        let data = s.data;
        data.segments(
            s.pos.saturating_sub(HEADER),
            usize::MAX,
            MAX_SLICES - k,
            |seg| {
                bufs[k] = IoSlice::new(seg);
                k += 1;
            },
        );
        let r = if k == 1 {
            l.stream.write(&bufs[0])
        } else {
            l.stream.write_vectored(&bufs[..k])
        };
        match r {
            Ok(0) => return Err(lost(op, s.peer, "connection closed while sending".into())),
            Ok(k) => {
                s.pos += k;
                progressed = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(lost(op, s.peer, format!("send failed: {e}"))),
        }
    }
    Ok(progressed)
}

/// Reads as much of `r` as has arrived; Ok(progressed).
fn pull(l: &mut Link, r: &mut RecvOp<'_>, op: &str) -> Result<bool, CommError> {
    let mut progressed = false;
    while !r.done() {
        let res = if r.hdr_got < HEADER {
            l.stream.read(&mut r.hdr[r.hdr_got..])
        } else {
            l.stream.read(&mut r.buf[r.got..])
        };
        match res {
            Ok(0) => {
                return Err(lost(
                    op,
                    r.peer,
                    "connection closed (the process exited or crashed)".into(),
                ))
            }
            Ok(k) => {
                progressed = true;
                if r.hdr_got < HEADER {
                    r.hdr_got += k;
                    if r.hdr_got == HEADER {
                        let (magic, tag, len) = parse(&r.hdr);
                        if magic != MAGIC || tag != r.tag || len != r.buf.len() as u64 {
                            return Err(CommError::Mismatch {
                                op: op.to_string(),
                                detail: format!(
                                    "rank {} sent {tag:?} with {len} bytes (magic {magic:#x}); expected {:?} with {} bytes",
                                    r.peer,
                                    r.tag,
                                    r.buf.len()
                                ),
                            });
                        }
                    }
                } else {
                    r.got += k;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(lost(op, r.peer, format!("receive failed: {e}"))),
        }
    }
    Ok(progressed)
}

impl Links {
    /// Queues a copy of a point-to-point message and writes what the socket takes now.
    pub fn post(&mut self, op: &str, peer: usize, tag: Tag, data: &[u8]) -> Result<(), CommError> {
        let l = self
            .links
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| lost(op, peer, "no connection".into()))?;
        let mut msg = Vec::with_capacity(HEADER + data.len());
        msg.extend_from_slice(&header(tag, data.len()));
        msg.extend_from_slice(data);
        l.pending.push_back(msg);
        flush_pending(l, op, peer).map(|_| ())
    }

    /// `f` on the connections, unless an earlier failure left them unusable (a `Mismatch` of
    /// `op` then); a failure of `f` leaves them unusable.
    pub fn guarded<R>(
        &mut self,
        op: &str,
        f: impl FnOnce(&mut Links) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        if let Some(b) = &self.broken {
            return Err(CommError::Mismatch {
                op: op.to_string(),
                detail: format!("the connections are unusable after an earlier failure: {b}"),
            });
        }
        let res = f(self);
        if let Err(e) = &res {
            self.broken = Some(e.to_string());
        }
        res
    }

    /// Runs `sends` and `recvs` to completion (messages to/from one peer go in slice order),
    /// calling `progress` whenever bytes arrived. Fails after `timeout` naming the peers whose
    /// messages are incomplete. Run it `guarded`: a failure may leave messages half written.
    pub fn run(
        &mut self,
        op: &str,
        sends: &mut [SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        timeout: Duration,
        progress: &mut dyn FnMut(&[RecvOp<'_>]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let deadline = Instant::now() + timeout;
        let np = self.links.len();
        for s in sends.iter() {
            if self.links.get(s.peer).and_then(Option::as_ref).is_none() {
                return Err(lost(op, s.peer, "no connection".into()));
            }
        }
        for r in recvs.iter() {
            if self.links.get(r.peer).and_then(Option::as_ref).is_none() {
                return Err(lost(op, r.peer, "no connection".into()));
            }
        }
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(np);
        let mut fd_peer: Vec<usize> = Vec::with_capacity(np);
        let mut want_out = vec![false; np];
        let mut want_in = vec![false; np];
        loop {
            // Progress every peer as far as the sockets allow.
            let mut arrived = false;
            want_out.iter_mut().for_each(|w| *w = false);
            want_in.iter_mut().for_each(|w| *w = false);
            for (p, slot) in self.links.iter_mut().enumerate() {
                let Some(l) = slot.as_mut() else { continue };
                if !flush_pending(l, op, p)? {
                    want_out[p] = true;
                    continue;
                }
                if let Some(s) = sends.iter_mut().find(|s| s.peer == p && !s.done()) {
                    push(l, s, op)?;
                    if !s.done() {
                        want_out[p] = true;
                    }
                }
            }
            let mut all_done = true;
            for (p, slot) in self.links.iter_mut().enumerate() {
                let Some(l) = slot.as_mut() else {
                    continue;
                };
                while let Some(r) = recvs.iter_mut().find(|r| r.peer == p && !r.done()) {
                    arrived |= pull(l, r, op)?;
                    if !r.done() {
                        want_in[p] = true;
                        break;
                    }
                }
            }
            if arrived {
                progress(recvs)?;
            }
            if sends.iter().any(|s| !s.done()) || recvs.iter().any(|r| !r.done()) {
                all_done = false;
            }
            if all_done {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                let mut missing: Vec<usize> = sends
                    .iter()
                    .filter(|s| !s.done())
                    .map(|s| s.peer)
                    .chain(recvs.iter().filter(|r| !r.done()).map(|r| r.peer))
                    .collect();
                missing.sort_unstable();
                missing.dedup();
                return Err(CommError::Timeout {
                    op: op.to_string(),
                    timeout,
                    missing,
                });
            }
            fds.clear();
            fd_peer.clear();
            for p in 0..np {
                if !(want_in[p] || want_out[p]) {
                    continue;
                }
                if let Some(l) = self.links[p].as_ref() {
                    let mut events = 0;
                    if want_in[p] {
                        events |= libc::POLLIN;
                    }
                    if want_out[p] {
                        events |= libc::POLLOUT;
                    }
                    fds.push(libc::pollfd {
                        fd: l.stream.as_raw_fd(),
                        events,
                        revents: 0,
                    });
                    fd_peer.push(p);
                }
            }
            let wait_ms = (deadline - now).as_millis().clamp(1, 1000) as libc::c_int;
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != ErrorKind::Interrupted {
                    return Err(CommError::Io {
                        context: format!("{op}: poll"),
                        source: e,
                    });
                }
            }
        }
    }

    /// Writes buffered point-to-point sends, waiting at most `timeout` (used on drop).
    pub fn drain(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        for (p, slot) in self.links.iter_mut().enumerate() {
            let Some(l) = slot.as_mut() else { continue };
            while let Ok(false) = flush_pending(l, "drop", p) {
                if Instant::now() >= deadline {
                    return;
                }
                let mut fd = libc::pollfd {
                    fd: l.stream.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut fd, 1, 10) };
            }
        }
    }
}
