//! `StoreClient`: a synchronous, thread-safe client of the rendezvous store (an internal
//! current-thread tokio runtime; every call carries the token and a deadline).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

use super::config::{validate_token, DEFAULT_MAX_MESSAGE_BYTES};
use super::long_wait::LongWait;
use super::proto;
use super::proto::store_client::StoreClient as GrpcClient;
use super::{random_hex, TOKEN_METADATA_KEY};
use crate::CommError;

/// Client settings beyond address, token and connect timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Largest gRPC message sent or accepted, in bytes.
    pub max_message_bytes: usize,
    /// Deadline of each non-waiting call (set, get, add, delete, compare_set).
    pub rpc_timeout: Duration,
    /// Who waits, as the notices of a long connect say it (`LongWait`): `rank 1 of 4`,
    /// `oflaunch on node 1`.
    pub caller: String,
    /// The flag or variable that sets the connect timeout, as the notices name it.
    pub limit_name: &'static str,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            rpc_timeout: Duration::from_secs(60),
            caller: format!("process {}", std::process::id()),
            limit_name: "the connect timeout",
        }
    }
}

struct Inner {
    runtime: Option<tokio::runtime::Runtime>,
    grpc: GrpcClient<Channel>,
    token: MetadataValue<Ascii>,
    addr: String,
    options: ClientOptions,
    /// The server's cap on one wait call; longer waits are re-issued.
    server_max_wait: Duration,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            // Safe to call even from inside another runtime (a plain drop would panic there).
            rt.shutdown_background();
        }
    }
}

/// A connection to the rendezvous store. Cheap to clone; `Send + Sync`: clones and shared
/// references may be used from several threads at once.
#[derive(Clone)]
pub struct StoreClient {
    inner: Arc<Inner>,
    /// Prepended to every key and barrier name (see `with_prefix`); empty by default.
    prefix: Arc<str>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.inner.addr)
            .finish()
    }
}

/// Runs `fut` to completion on `rt`, from a helper thread when the caller is itself inside a
/// tokio runtime (where `block_on` is not allowed).
fn block_on<F>(rt: &tokio::runtime::Runtime, fut: F) -> F::Output
where
    F: Future + Send,
    F::Output: Send,
{
    if tokio::runtime::Handle::try_current().is_ok() {
        std::thread::scope(|s| match s.spawn(|| rt.block_on(fut)).join() {
            Ok(v) => v,
            Err(payload) => std::panic::resume_unwind(payload),
        })
    } else {
        rt.block_on(fut)
    }
}

/// An error with its sources (a transport error says only "transport error" itself).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    let mut last = text.clone();
    while let Some(s) = source {
        let part = s.to_string();
        // Layers often repeat their inner error's words; each is said once.
        if part != last {
            text.push_str(": ");
            text.push_str(&part);
        }
        last = part;
        source = s.source();
    }
    text
}

/// Milliseconds rounded up, so a server-side wait never ends before the client's deadline.
fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// A failure of the connection rather than an answer of the store. The store itself never
/// answers `Cancelled`: that code comes from the transport when a request was queued on a
/// connection that closed (a store that restarted), and the client's own deadline is enforced
/// separately, so a retry within the deadline is safe for idempotent calls.
fn is_transient(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable => !status.message().contains("shutting down"),
        Code::Unknown => status.message().contains("transport error"),
        Code::Cancelled => true,
        _ => false,
    }
}

fn status_error(op: &str, addr: &str, status: &Status) -> CommError {
    let msg = status.message();
    match status.code() {
        Code::Unauthenticated => {
            CommError::Unauthenticated(format!("{op} at {addr}: wrong or missing token ({msg})"))
        }
        Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted => {
            CommError::InvalidArgument {
                op: format!("rendezvous {op} at {addr}"),
                detail: format!("the store refused the request: {msg}"),
            }
        }
        Code::FailedPrecondition => CommError::Mismatch {
            op: format!("rendezvous {op} at {addr}"),
            detail: msg.to_string(),
        },
        Code::DeadlineExceeded | Code::Cancelled => CommError::Rendezvous(format!(
            "{op} at {addr}: no answer from the store in time ({msg})"
        )),
        Code::Unavailable => {
            CommError::Rendezvous(format!("{op} at {addr}: store unavailable ({msg})"))
        }
        code => CommError::Rendezvous(format!("{op} at {addr}: {code:?}: {msg}")),
    }
}

impl StoreClient {
    /// Connects to the store at `addr` (`host:port`), retrying until it answers or `timeout`
    /// passes; a wrong token fails at once with `CommError::Unauthenticated`.
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<StoreClient, CommError> {
        StoreClient::connect_with(addr, token, timeout, ClientOptions::default())
    }

    /// As `connect`, with explicit options.
    pub fn connect_with(
        addr: &str,
        token: &str,
        timeout: Duration,
        options: ClientOptions,
    ) -> Result<StoreClient, CommError> {
        validate_token(token, "rendezvous connect")?;
        let bad_addr = |detail: String| CommError::InvalidArgument {
            op: "rendezvous connect".into(),
            detail,
        };
        if addr.contains("://") || addr.is_empty() {
            return Err(bad_addr(format!("address {addr:?} must be host:port")));
        }
        let token_value: MetadataValue<Ascii> = token
            .parse()
            .map_err(|_| bad_addr("the token is not valid gRPC metadata".into()))?;
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| bad_addr(format!("address {addr:?} is not host:port: {e}")))?
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(20))
            .connect_timeout(timeout.clamp(Duration::from_millis(1), Duration::from_secs(5)));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| CommError::Io {
                context: "rendezvous connect: start tokio runtime".into(),
                source,
            })?;
        let cap = options.max_message_bytes;
        let deadline = Instant::now() + timeout;
        let mut notice = LongWait::new(timeout, options.limit_name);
        let connect = async {
            let mut backoff = Duration::from_millis(20);
            loop {
                let last_error = match endpoint.connect().await {
                    Ok(channel) => {
                        let mut grpc = GrpcClient::new(channel)
                            .max_decoding_message_size(cap)
                            .max_encoding_message_size(cap);
                        let mut req = Request::new(proto::PingRequest {});
                        req.metadata_mut()
                            .insert(TOKEN_METADATA_KEY, token_value.clone());
                        let left = deadline.saturating_duration_since(Instant::now());
                        req.set_timeout(left.max(Duration::from_millis(100)));
                        match tokio::time::timeout(
                            left.max(Duration::from_millis(100)),
                            grpc.ping(req),
                        )
                        .await
                        {
                            Ok(Ok(pong)) => return Ok((grpc, pong.into_inner())),
                            Ok(Err(status)) if status.code() == Code::Unauthenticated => {
                                return Err(status_error("connect", addr, &status));
                            }
                            Ok(Err(status)) => format!("{:?}: {}", status.code(), status.message()),
                            Err(_) => "no answer to ping".to_string(),
                        }
                    }
                    Err(e) => with_sources(&e),
                };
                notice.tick(|| {
                    format!(
                        "{}: waiting for the rendezvous store at {addr}, which does not answer \
                         ({last_error})",
                        options.caller
                    )
                });
                let now = Instant::now();
                if now >= deadline {
                    return Err(CommError::Rendezvous(format!(
                        "connect: no rendezvous store answered at {addr} within {timeout:?} (last error: {last_error})"
                    )));
                }
                tokio::time::sleep(backoff.min(deadline - now)).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        };
        let (grpc, pong) = block_on(&runtime, connect)?;
        let server_max_wait = Duration::from_millis(pong.max_wait_ms.max(1));
        Ok(StoreClient {
            inner: Arc::new(Inner {
                runtime: Some(runtime),
                grpc,
                token: token_value,
                addr: addr.to_string(),
                options,
                server_max_wait,
            }),
            prefix: Arc::from(""),
        })
    }

    /// A handle on the same connection whose keys and barrier names all start with `prefix`
    /// (added to this handle's own prefix). oflaunch gives each restart generation its own
    /// prefix (`OXIFLOW_STORE_PREFIX`), so a restarted job never reads the last one's keys.
    pub fn with_prefix(&self, prefix: &str) -> StoreClient {
        StoreClient {
            inner: Arc::clone(&self.inner),
            prefix: Arc::from(format!("{}{prefix}", self.prefix)),
        }
    }

    /// The prefix this handle puts before every key.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn full_key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}{key}", self.prefix)
        }
    }

    /// The address this client talks to.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    fn request<T>(&self, msg: T, timeout: Duration) -> Request<T> {
        let mut req = Request::new(msg);
        req.metadata_mut()
            .insert(TOKEN_METADATA_KEY, self.inner.token.clone());
        req.set_timeout(timeout);
        req
    }

    /// Runs one RPC with a client-side deadline as well as the gRPC one. With `retry` (for
    /// idempotent calls), a transient transport failure (a connection that broke, a store that
    /// restarted) is retried a few times within the deadline.
    fn call<M, T, F, Fut>(
        &self,
        op: &str,
        timeout: Duration,
        retry: bool,
        msg: M,
        f: F,
    ) -> Result<T, CommError>
    where
        M: Clone + Send + Sync,
        F: Fn(GrpcClient<Channel>, Request<M>) -> Fut + Send + Sync,
        Fut: Future<Output = Result<tonic::Response<T>, Status>> + Send,
        T: Send,
    {
        let rt = self.inner.runtime.as_ref().ok_or_else(|| {
            CommError::Rendezvous(format!(
                "{op} at {}: the client is shut down",
                self.inner.addr
            ))
        })?;
        let attempts = if retry { 4 } else { 1 };
        let result = block_on(rt, async {
            let deadline = Instant::now() + timeout;
            let mut backoff = Duration::from_millis(25);
            let mut attempt = 1;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let req = self.request(msg.clone(), left);
                let out = tokio::time::timeout(left, f(self.inner.grpc.clone(), req)).await;
                match out {
                    Ok(Err(status)) if attempt < attempts && is_transient(&status) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left <= backoff {
                            return Ok(Err(status));
                        }
                        tokio::time::sleep(backoff).await;
                        backoff *= 2;
                        attempt += 1;
                    }
                    other => return other,
                }
            }
        });
        match result {
            Ok(Ok(resp)) => Ok(resp.into_inner()),
            Ok(Err(status)) => Err(status_error(op, &self.inner.addr, &status)),
            Err(_) => Err(CommError::Rendezvous(format!(
                "{op} at {}: no answer from the store within {timeout:?}",
                self.inner.addr
            ))),
        }
    }

    fn check_value_size(&self, op: &str, key: &str, len: usize) -> Result<(), CommError> {
        let cap = self.inner.options.max_message_bytes;
        if len.saturating_add(key.len()).saturating_add(64) > cap {
            return Err(CommError::InvalidArgument {
                op: format!("rendezvous {op} {key:?}"),
                detail: format!("value of {len} bytes does not fit the message cap of {cap} bytes"),
            });
        }
        Ok(())
    }

    /// Stores `value` under `key` (replacing any value), waking waiters on it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.check_value_size("set", key, value.len())?;
        let t = self.inner.options.rpc_timeout;
        let msg = proto::SetRequest {
            key: self.full_key(key),
            value: value.to_vec(),
        };
        self.call(
            "set",
            t,
            true,
            msg,
            |mut g, r| async move { g.set(r).await },
        )?;
        Ok(())
    }

    /// The value under `key`, if any; does not wait.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        let t = self.inner.options.rpc_timeout;
        let msg = proto::GetRequest {
            key: self.full_key(key),
        };
        let resp = self.call(
            "get",
            t,
            true,
            msg,
            |mut g, r| async move { g.get(r).await },
        )?;
        Ok(resp.found.then_some(resp.value))
    }

    /// Waits until every key exists and returns their values in order; on timeout the error
    /// (`CommError::StoreTimeout`) names the keys still missing.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, CommError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let deadline = Instant::now() + timeout;
        let owned: Vec<String> = keys.iter().map(|k| self.full_key(k)).collect();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(self.inner.server_max_wait);
            let rpc_deadline = slice + self.inner.options.rpc_timeout.min(Duration::from_secs(10));
            let msg = proto::WaitRequest {
                keys: owned.clone(),
                timeout_ms: ceil_ms(slice),
            };
            let resp = self.call("wait", rpc_deadline, true, msg, |mut g, r| async move {
                g.wait(r).await
            })?;
            if resp.done {
                if resp.values.len() != keys.len() {
                    return Err(CommError::Rendezvous(format!(
                        "wait at {}: asked for {} keys, the store returned {} values",
                        self.inner.addr,
                        keys.len(),
                        resp.values.len()
                    )));
                }
                return Ok(resp.values);
            }
            if Instant::now() >= deadline {
                return Err(CommError::StoreTimeout {
                    op: format!(
                        "rendezvous wait for {} key(s) at {}",
                        keys.len(),
                        self.inner.addr
                    ),
                    timeout,
                    detail: format!("still missing key(s) {:?}", resp.missing),
                    missing_keys: resp.missing,
                });
            }
        }
    }

    /// As `wait`, saying every `NOTICE_EVERY` what it waits for: `what` gets the keys still
    /// missing (with this handle's prefix) and names them; `limit_name` is the flag or variable
    /// that sets `timeout`.
    pub fn wait_saying(
        &self,
        keys: &[&str],
        timeout: Duration,
        limit_name: &'static str,
        what: impl Fn(&[String]) -> String,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        let mut notice = LongWait::new(timeout, limit_name);
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let slice = left.min(notice.until_next().max(Duration::from_millis(1)));
            match self.wait(keys, slice) {
                Err(CommError::StoreTimeout {
                    op,
                    detail,
                    missing_keys,
                    ..
                }) => {
                    if std::time::Instant::now() >= deadline {
                        return Err(CommError::StoreTimeout {
                            op,
                            timeout,
                            detail,
                            missing_keys,
                        });
                    }
                    notice.tick(|| what(&missing_keys));
                }
                other => return other,
            }
        }
    }

    /// Atomically adds `delta` to the decimal integer under `key` (absent counts as 0) and
    /// returns the new value; the value is stored as its decimal text.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        let t = self.inner.options.rpc_timeout;
        let msg = proto::AddRequest {
            key: self.full_key(key),
            delta,
        };
        Ok(self
            .call(
                "add",
                t,
                false,
                msg,
                |mut g, r| async move { g.add(r).await },
            )?
            .value)
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, CommError> {
        let t = self.inner.options.rpc_timeout;
        let msg = proto::DeleteRequest {
            key: self.full_key(key),
        };
        Ok(self
            .call("delete", t, true, msg, |mut g, r| async move {
                g.delete(r).await
            })?
            .existed)
    }

    /// Sets `key` to `desired` only if its value is `expected` (`None`: absent). Returns whether
    /// it swapped and the value after the call.
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<(bool, Option<Vec<u8>>), CommError> {
        self.check_value_size("compare_set", key, desired.len())?;
        let t = self.inner.options.rpc_timeout;
        let msg = proto::CompareSetRequest {
            key: self.full_key(key),
            expected_absent: expected.is_none(),
            expected: expected.map(<[u8]>::to_vec).unwrap_or_default(),
            desired: desired.to_vec(),
        };
        let resp = self.call("compare_set", t, false, msg, |mut g, r| async move {
            g.compare_set(r).await
        })?;
        Ok((resp.swapped, resp.found.then_some(resp.value)))
    }

    /// Waits until `n` callers (this one included) are at barrier `name`. Barriers are
    /// reusable: once complete, the next `n` arrivals form the next round. On timeout the
    /// error says how many had arrived.
    pub fn barrier(&self, name: &str, n: usize, timeout: Duration) -> Result<(), CommError> {
        self.barrier_impl(name, None, n, timeout)
    }

    /// As `barrier`, arriving as `rank` of `0..n`; on timeout the error
    /// (`CommError::Timeout`) lists the ranks that did not arrive.
    pub fn barrier_as(
        &self,
        name: &str,
        rank: usize,
        n: usize,
        timeout: Duration,
    ) -> Result<(), CommError> {
        self.barrier_impl(name, Some(rank), n, timeout)
    }

    fn barrier_impl(
        &self,
        name: &str,
        rank: Option<usize>,
        n: usize,
        timeout: Duration,
    ) -> Result<(), CommError> {
        let op = format!("rendezvous barrier {name:?}");
        let invalid = |detail: String| CommError::InvalidArgument {
            op: op.clone(),
            detail,
        };
        let n32 = u32::try_from(n).map_err(|_| invalid(format!("n = {n} is too large")))?;
        let rank32 = match rank {
            Some(r) if r >= n => return Err(invalid(format!("rank {r} is outside 0..{n}"))),
            Some(r) => {
                Some(u32::try_from(r).map_err(|_| invalid(format!("rank {r} is too large")))?)
            }
            None => None,
        };
        let arrival_id = random_hex(16)?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(self.inner.server_max_wait);
            let rpc_deadline = slice + self.inner.options.rpc_timeout.min(Duration::from_secs(10));
            let msg = proto::BarrierRequest {
                name: self.full_key(name),
                n: n32,
                arrival_id: arrival_id.clone(),
                has_rank: rank32.is_some(),
                rank: rank32.unwrap_or(0),
                timeout_ms: ceil_ms(slice),
            };
            let resp = self.call("barrier", rpc_deadline, true, msg, |mut g, r| async move {
                g.barrier(r).await
            })?;
            if resp.done {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let arrived = resp.arrived;
                return Err(if rank.is_some() {
                    let missing: Vec<usize> = (0..n32)
                        .filter(|r| !resp.arrived_ranks.contains(r))
                        .map(|r| r as usize)
                        .collect();
                    CommError::Timeout {
                        op: format!("{op} ({arrived} of {n} arrived)"),
                        timeout,
                        missing,
                    }
                } else {
                    CommError::StoreTimeout {
                        op,
                        timeout,
                        missing_keys: Vec::new(),
                        detail: format!(
                            "{arrived} of {n} arrived, {} missing",
                            n.saturating_sub(arrived as usize)
                        ),
                    }
                });
            }
        }
    }
}
