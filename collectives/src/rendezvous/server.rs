//! `StoreServer`: serves the rendezvous store on the exact address given, on its own thread and
//! tokio runtime, with a connection cap and admission control (`admission`); dropping it stops
//! the server and frees the port.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;

use super::admission::{Admission, AdmittedStream};
use super::config::{validate_token, StoreConfig};
use super::proto::store_server::StoreServer as GrpcStoreServer;
use super::refusals::RefusalLog;
use super::service::{StoreService, TokenCheck};
use super::state::StoreState;
use crate::CommError;

/// Connections the kernel queues before the store accepts them (capped by
/// net.core.somaxconn): deep enough that a burst of connections does not make the job's own
/// ranks wait for a SYN retransmission.
const LISTEN_BACKLOG: u32 = 4096;

/// How long a stopping server lets in-flight requests finish before it drops them.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);

/// A running rendezvous store. Stops when dropped (or on `shutdown`).
pub struct StoreServer {
    local_addr: SocketAddr,
    state: Arc<StoreState>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl StoreServer {
    /// Binds exactly `addr` (port 0 picks a free port; see `local_addr`) and serves the store
    /// with the default limits, requiring `token` on every request.
    pub fn bind(addr: SocketAddr, token: String) -> Result<StoreServer, CommError> {
        StoreServer::bind_with(addr, token, StoreConfig::default())
    }

    /// As `bind`, with explicit limits.
    pub fn bind_with(
        addr: SocketAddr,
        token: String,
        config: StoreConfig,
    ) -> Result<StoreServer, CommError> {
        validate_token(&token, "rendezvous store bind")?;
        config.validate()?;
        let io_err = |context: String| move |source: io::Error| CommError::Io { context, source };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_err("rendezvous store: start tokio runtime".to_string()))?;
        let listener = {
            // The listener registers with this runtime's reactor.
            let _in_runtime = runtime.enter();
            let socket = if addr.is_ipv4() {
                TcpSocket::new_v4()
            } else {
                TcpSocket::new_v6()
            }
            .map_err(io_err(format!("rendezvous store: socket for {addr}")))?;
            socket
                .set_reuseaddr(true)
                .map_err(io_err(format!("rendezvous store: SO_REUSEADDR on {addr}")))?;
            socket
                .bind(addr)
                .map_err(io_err(format!("rendezvous store: cannot bind {addr}")))?;
            socket
                .listen(LISTEN_BACKLOG)
                .map_err(io_err(format!("rendezvous store: cannot listen on {addr}")))?
        };
        let local_addr = listener
            .local_addr()
            .map_err(io_err(format!("rendezvous store: local_addr of {addr}")))?;
        let state = StoreState::new(config);
        let (stop, stop_rx) = oneshot::channel();
        let thread_state = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name(format!("oxiflow-store-{}", local_addr.port()))
            .spawn(move || {
                runtime.block_on(serve(listener, token, thread_state, stop_rx));
                // Dropping the runtime cancels whatever connection tasks are left.
            })
            .map_err(io_err("rendezvous store: spawn server thread".to_string()))?;
        tracing::debug!(%local_addr, "rendezvous store listening");
        Ok(StoreServer {
            local_addr,
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address actually bound (with the port chosen when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// How many wait and barrier calls are blocked in the server now (a diagnostic: tests use it
    /// to know that a call has reached the server before they act).
    pub fn blocked_calls(&self) -> usize {
        self.state.blocked_calls()
    }

    /// Stops the server: pending waits return `unavailable`, the port is closed on return.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.state.close();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!(addr = %self.local_addr, "rendezvous store thread panicked");
            }
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Serves until `stop` fires, then gives in-flight requests `SHUTDOWN_GRACE` to finish.
async fn serve(
    listener: TcpListener,
    token: String,
    state: Arc<StoreState>,
    stop: oneshot::Receiver<()>,
) {
    let config = state.config().clone();
    let (conn_tx, conn_rx) = mpsc::channel::<io::Result<AdmittedStream>>(64);
    let accept = tokio::spawn(accept_loop(listener, conn_tx, config.clone()));

    let cap = config.max_message_bytes;
    let grpc = GrpcStoreServer::new(StoreService::new(Arc::clone(&state)))
        .max_decoding_message_size(cap)
        .max_encoding_message_size(cap);
    let service = InterceptedService::new(grpc, TokenCheck::new(&token));
    let (stopped_tx, stopped_rx) = oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .timeout(config.max_wait + Duration::from_secs(10))
        .http2_max_header_list_size(64 * 1024)
        .max_concurrent_streams(1024)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .tcp_nodelay(true)
        .add_service(service)
        .serve_with_incoming_shutdown(ReceiverStream::new(conn_rx), async move {
            let _ = stop.await;
            let _ = stopped_tx.send(());
        });
    let hard_stop = async move {
        let _ = stopped_rx.await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        result = server => {
            if let Err(e) = result {
                tracing::error!(error = %e, "rendezvous store stopped with an error");
            }
        }
        () = hard_stop => {}
    }
    accept.abort();
}

/// Accepts connections into the admission table. At the connection cap, the oldest connection
/// that has not presented the token is closed and the new one is refused.
async fn accept_loop(
    listener: TcpListener,
    tx: mpsc::Sender<io::Result<AdmittedStream>>,
    config: StoreConfig,
) {
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let admission = Admission::new(config.max_pending_per_peer, config.handshake_timeout);
    let at_cap = RefusalLog::new("rendezvous store refused connections at its connection cap");
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "rendezvous store: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            admission.evict_oldest();
            at_cap.record(peer.ip());
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = admission.admit(stream, peer.ip(), permit);
        if tx.send(Ok(conn)).await.is_err() {
            return;
        }
    }
}
