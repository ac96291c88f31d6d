//! Bootstrap of the TCP data plane: every rank listens on an ephemeral port of the given host,
//! publishes `host:port` in the rendezvous store, and the ranks build a full mesh (rank i
//! connects to every lower rank and accepts every higher one), each connection verified by a
//! handshake carrying the job nonce (returned: it also names the shared-memory segments), the
//! world size and the rank.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::rendezvous::StoreClient;
use crate::CommError;

const HELLO_MAGIC: &[u8; 8] = b"OXFMESH1";
pub(crate) const NONCE: usize = 16;
pub(super) const HELLO: usize = 8 + NONCE + 8;
const SOCKET_BUFFER: libc::c_int = 4 << 20;
pub(crate) const KEY_PREFIX: &str = "oxiflow/tcp";

fn io(context: String) -> impl FnOnce(std::io::Error) -> CommError {
    move |source| CommError::Io { context, source }
}

/// The first address `addr` resolves to; an I/O error under `context` where resolving fails,
/// `none()` where it gives no address.
pub(crate) fn resolve(
    addr: impl ToSocketAddrs,
    context: String,
    none: impl FnOnce() -> CommError,
) -> Result<SocketAddr, CommError> {
    addr.to_socket_addrs()
        .map_err(io(context))?
        .next()
        .ok_or_else(none)
}

pub(super) fn hello(nonce: &[u8; NONCE], rank: usize, world: usize) -> [u8; HELLO] {
    let mut h = [0u8; HELLO];
    h[..8].copy_from_slice(HELLO_MAGIC);
    h[8..8 + NONCE].copy_from_slice(nonce);
    h[8 + NONCE..8 + NONCE + 4].copy_from_slice(&(rank as u32).to_le_bytes());
    h[8 + NONCE + 4..].copy_from_slice(&(world as u32).to_le_bytes());
    h
}

/// The rank a hello announces, if it belongs to this job.
pub(super) fn check_hello(h: &[u8; HELLO], nonce: &[u8; NONCE], world: usize) -> Option<usize> {
    let u = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]) as usize;
    (&h[..8] == HELLO_MAGIC && &h[8..8 + NONCE] == nonce && u(8 + NONCE + 4) == world)
        .then(|| u(8 + NONCE))
}

fn tune(s: &TcpStream) -> Result<(), CommError> {
    s.set_nodelay(true)
        .map_err(io("tcp: set TCP_NODELAY".into()))?;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt on an open socket with a c_int value.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &SOCKET_BUFFER as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    Ok(())
}

fn store_timeout(
    op: &str,
    timeout: Duration,
    e: CommError,
    key_rank: impl Fn(&str) -> Option<usize>,
) -> CommError {
    match e {
        CommError::StoreTimeout { missing_keys, .. } => CommError::Timeout {
            op: op.to_string(),
            timeout,
            missing: missing_keys.iter().filter_map(|k| key_rank(k)).collect(),
        },
        other => other,
    }
}

/// Connects this rank to every other rank; `streams[r]` is the verified connection to rank r.
pub(crate) fn build(
    store: &StoreClient,
    rank: usize,
    world: usize,
    bind_host: &str,
    timeout: Duration,
) -> Result<(Vec<Option<TcpStream>>, [u8; NONCE]), CommError> {
    let op = "tcp bootstrap";
    let deadline = Instant::now() + timeout;
    let bind = resolve(
        (bind_host, 0),
        format!("{op}: resolve bind host {bind_host:?}"),
        || CommError::InvalidArgument {
            op: op.into(),
            detail: format!("bind host {bind_host:?} resolves to no address"),
        },
    )?;
    let listener = TcpListener::bind(bind).map_err(io(format!("{op}: listen on {bind}")))?;
    let local = listener
        .local_addr()
        .map_err(io(format!("{op}: local address")))?;
    let advertised = if local.ip().is_unspecified() {
        // Bound to all interfaces on request: advertise the name we were given... which is
        // useless to peers, so fall back to the loopback of this host.
        SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), local.port())
    } else {
        local
    };
    let nonce_key = format!("{KEY_PREFIX}/nonce");
    if rank == 0 {
        let mut n = [0u8; NONCE];
        getrandom::getrandom(&mut n)
            .map_err(|e| CommError::Rendezvous(format!("{op}: random nonce: {e}")))?;
        store.set(&nonce_key, &n)?;
    }
    store.set(
        &format!("{KEY_PREFIX}/addr/{rank}"),
        advertised.to_string().as_bytes(),
    )?;
    let nonce_v = store
        .wait(&[&nonce_key], timeout)
        .map_err(|e| store_timeout(op, timeout, e, |_| Some(0)))?;
    let nonce: [u8; NONCE] = nonce_v
        .first()
        .and_then(|v| v.as_slice().try_into().ok())
        .ok_or_else(|| CommError::Rendezvous(format!("{op}: malformed job nonce in the store")))?;
    let keys: Vec<String> = (0..world)
        .map(|r| format!("{KEY_PREFIX}/addr/{r}"))
        .collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let left = deadline.saturating_duration_since(Instant::now());
    let addrs = store.wait(&key_refs, left).map_err(|e| {
        store_timeout(op, timeout, e, |k| {
            k.rsplit('/').next().and_then(|r| r.parse().ok())
        })
    })?;
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let me = hello(&nonce, rank, world);
    // Connect to every lower rank.
    for (peer, a) in addrs.iter().enumerate().take(rank) {
        let text = String::from_utf8_lossy(a).into_owned();
        let addr: SocketAddr = text.parse().map_err(|e| {
            CommError::Rendezvous(format!(
                "{op}: rank {peer} published bad address {text:?}: {e}"
            ))
        })?;
        let s = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CommError::Timeout {
                    op: format!("{op}: connect to {addr}"),
                    timeout,
                    missing: vec![peer],
                });
            }
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
                Ok(s) => break s,
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        s.set_read_timeout(Some(left))
            .map_err(io(format!("{op}: read timeout")))?;
        (&s).write_all(&me)
            .map_err(io(format!("{op}: hello to rank {peer}")))?;
        let mut h = [0u8; HELLO];
        (&s).read_exact(&mut h).map_err(|e| CommError::PeerLost {
            op: op.into(),
            rank: peer,
            detail: format!("no handshake answer from {addr}: {e}"),
        })?;
        if check_hello(&h, &nonce, world) != Some(peer) {
            return Err(CommError::Mismatch {
                op: op.into(),
                detail: format!(
                    "{addr} (published by rank {peer}) answered with a foreign handshake"
                ),
            });
        }
        streams[peer] = Some(s);
    }
    // Accept every higher rank; connections that fail the handshake are dropped.
    listener
        .set_nonblocking(true)
        .map_err(io(format!("{op}: nonblocking listener")))?;
    while streams[rank + 1..].iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(CommError::Timeout {
                op: format!("{op}: accept on {advertised}"),
                timeout,
                missing: (rank + 1..world)
                    .filter(|&r| streams[r].is_none())
                    .collect(),
            });
        }
        let mut fd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut fd, 1, left.as_millis().clamp(1, 1000) as libc::c_int) };
        let Ok((s, from)) = listener.accept() else {
            continue;
        };
        let ok = s.set_nonblocking(false).is_ok()
            && s.set_read_timeout(Some(left.min(Duration::from_secs(10))))
                .is_ok();
        let mut h = [0u8; HELLO];
        if !ok || (&s).read_exact(&mut h).is_err() {
            tracing::warn!(%from, "tcp bootstrap: dropped a connection without handshake");
            continue;
        }
        match check_hello(&h, &nonce, world) {
            Some(peer) if peer > rank && peer < world && streams[peer].is_none() => {
                (&s).write_all(&me)
                    .map_err(io(format!("{op}: hello to rank {peer}")))?;
                streams[peer] = Some(s);
            }
            _ => {
                tracing::warn!(%from, "tcp bootstrap: refused a connection with a foreign handshake")
            }
        }
    }
    for s in streams.iter().flatten() {
        tune(s)?;
        s.set_read_timeout(None)
            .map_err(io(format!("{op}: clear read timeout")))?;
        s.set_nonblocking(true)
            .map_err(io(format!("{op}: nonblocking stream")))?;
    }
    Ok((streams, nonce))
}
