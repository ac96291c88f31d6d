//! Admission of store connections: a connection is *pending* until a request on it carries
//! the job token. Pending connections have a handshake deadline, and each peer address may hold
//! only so many of them (its oldest is closed when it opens one more), so partial prefaces and
//! silent sockets cannot fill the connection cap and keep the job's own ranks out.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, OwnedSemaphorePermit};
use tokio::time::Sleep;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::refusals::RefusalLog;

/// The pending connections, oldest first, and who holds them.
#[derive(Default)]
struct Pending {
    next_id: u64,
    /// Connection id (increasing with age) -> its peer and the handle that closes it.
    by_id: BTreeMap<u64, (IpAddr, oneshot::Sender<()>)>,
    by_peer: HashMap<IpAddr, BTreeSet<u64>>,
}

impl Pending {
    fn remove(&mut self, id: u64) -> Option<oneshot::Sender<()>> {
        let (peer, close) = self.by_id.remove(&id)?;
        if let Some(ids) = self.by_peer.get_mut(&peer) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_peer.remove(&peer);
            }
        }
        Some(close)
    }
}

/// The admission table shared by the accept loop, the connections and the token check.
pub(crate) struct Admission {
    pending: Mutex<Pending>,
    max_pending_per_peer: usize,
    handshake_timeout: Duration,
    evictions: RefusalLog,
}

/// One connection's place in the admission table. Cloned into every request's extensions
/// (see `StoreConnectInfo`), so the token check can admit the connection.
pub(crate) struct Ticket {
    id: u64,
    peer: IpAddr,
    authenticated: AtomicBool,
    admission: Arc<Admission>,
}

impl Ticket {
    /// Marks the connection as carrying the job token: no deadline, never evicted.
    pub fn authenticate(&self) {
        if !self.authenticated.swap(true, Ordering::SeqCst) {
            self.admission.lock().remove(self.id);
        }
    }

    fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::SeqCst)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admission.lock().remove(self.id);
    }
}

impl Admission {
    pub fn new(max_pending_per_peer: usize, handshake_timeout: Duration) -> Arc<Admission> {
        Arc::new(Admission {
            pending: Mutex::new(Pending::default()),
            max_pending_per_peer,
            handshake_timeout,
            evictions: RefusalLog::new("rendezvous store closed connections that did not present the job token in time or were crowded out by newer ones from the same peer"),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Every update is a few map operations that leave the maps consistent.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a new connection from `peer` as pending; if that peer already holds its limit
    /// of pending connections, its oldest one is closed.
    pub fn admit(
        self: &Arc<Self>,
        stream: TcpStream,
        peer: IpAddr,
        permit: OwnedSemaphorePermit,
    ) -> AdmittedStream {
        let (close, closed) = oneshot::channel();
        let id = {
            let mut pending = self.lock();
            let id = pending.next_id;
            pending.next_id += 1;
            let oldest = pending
                .by_peer
                .get(&peer)
                .filter(|ids| ids.len() >= self.max_pending_per_peer)
                .and_then(|ids| ids.first().copied());
            if let Some(evicted) = oldest.and_then(|old| pending.remove(old)) {
                let _ = evicted.send(());
                self.evictions.record(peer);
            }
            pending.by_id.insert(id, (peer, close));
            pending.by_peer.entry(peer).or_default().insert(id);
            id
        };
        AdmittedStream {
            inner: stream,
            _permit: permit,
            ticket: Arc::new(Ticket {
                id,
                peer,
                authenticated: AtomicBool::new(false),
                admission: Arc::clone(self),
            }),
            closed: Some(closed),
            deadline: Some(Box::pin(tokio::time::sleep(self.handshake_timeout))),
        }
    }

    /// Closes the oldest pending connection of any peer (when the connection cap is reached);
    /// false when every connection is authenticated.
    pub fn evict_oldest(&self) -> bool {
        let mut pending = self.lock();
        let Some(oldest) = pending.by_id.keys().next().copied() else {
            return false;
        };
        let peer = pending.by_id.get(&oldest).map(|(p, _)| *p);
        if let Some(close) = pending.remove(oldest) {
            let _ = close.send(());
        }
        if let Some(peer) = peer {
            self.evictions.record(peer);
        }
        true
    }
}

/// What tonic puts into every request's extensions for a store connection.
#[derive(Clone)]
pub(crate) struct StoreConnectInfo {
    pub tcp: TcpConnectInfo,
    pub ticket: Arc<Ticket>,
}

impl StoreConnectInfo {
    pub fn peer(&self) -> String {
        self.tcp
            .remote_addr()
            .map_or_else(|| self.ticket.peer.to_string(), |a| a.to_string())
    }
}

/// A TCP connection holding one slot of the connection cap until it closes. Until it is
/// authenticated, reading from it fails once its handshake deadline passes or it is evicted,
/// which makes the HTTP/2 server drop it.
pub(crate) struct AdmittedStream {
    inner: TcpStream,
    _permit: OwnedSemaphorePermit,
    ticket: Arc<Ticket>,
    closed: Option<oneshot::Receiver<()>>,
    deadline: Option<Pin<Box<Sleep>>>,
}

impl AdmittedStream {
    /// Err when the (still pending) connection must close now; registers the waker otherwise.
    fn check_admission(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.ticket.is_authenticated() {
            self.closed = None;
            self.deadline = None;
            return Ok(());
        }
        if let Some(closed) = self.closed.as_mut() {
            match Pin::new(closed).poll(cx) {
                Poll::Ready(Ok(())) => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "closed to make room for newer connections",
                    ))
                }
                // The table let go of it: authenticated meanwhile.
                Poll::Ready(Err(_)) => self.closed = None,
                Poll::Pending => {}
            }
        }
        if let Some(deadline) = self.deadline.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() && !self.ticket.is_authenticated() {
                self.ticket.admission.evictions.record(self.ticket.peer);
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no request with the job token within the handshake deadline",
                ));
            }
        }
        Ok(())
    }
}

impl Connected for AdmittedStream {
    type ConnectInfo = StoreConnectInfo;
    fn connect_info(&self) -> StoreConnectInfo {
        StoreConnectInfo {
            tcp: self.inner.connect_info(),
            ticket: Arc::clone(&self.ticket),
        }
    }
}

impl AsyncRead for AdmittedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Err(e) = self.check_admission(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for AdmittedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
