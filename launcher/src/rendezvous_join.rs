//! The job's rendezvous: node 0 serves the store (on exactly --master-addr, port 0 = a free
//! port picked by the bind itself); every node joins through it before spawning workers.
//!
//! Keys (all under `oflaunch/`):
//! - `config`: node 0's `nnodes nproc`, read by the other nodes to check their own options.
//! - `claim/<node>`: counter; a second oflaunch claiming the same node rank is refused.
//! - `node/<node>`: `nnodes nproc host` registered by each non-zero node.
//! - `verdict/<node>`: node 0's answer, `ok` or the reason the job was refused.
//! - `failed/g<gen>`: the first failure of generation `gen` (see `Failure::encode`); every
//!   node polls it, so a failure anywhere stops the workers everywhere.
//! - `failack/g<gen>/<node>`: a node saw that failure; node 0 keeps the store up (a bounded
//!   while) until every node has seen it, so nobody learns of it only as a lost store.
//! - `verdict_ack/<node>`: a node read a refusing verdict (same purpose).
//! - `restart/g<gen>/<node>`: a node stopped its workers of generation `gen`; every node waits
//!   for all of them before restarting.
//! - `done/<node>`: set when a node's workers all succeeded; node 0 keeps the store up until
//!   every node is done (or failed, or `--timeout` passed), and the others retry it while
//!   node 0 does not answer, so the nodes agree on how the job ended.
//!
//! Every wait longer than 10 s says what it waits for (`LongWait`), every 10 s.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oxiflow_collectives::rendezvous::{
    generate_token, ClientOptions, LongWait, StoreClient, StoreServer,
};
use oxiflow_collectives::CommError;

use crate::error::LaunchError;
use crate::summary::Failure;

/// How long one poll of the store waits before checking the local state again.
const POLL: Duration = Duration::from_millis(500);
/// Deadline of oflaunch's own store calls beyond their waits: the store answers in
/// milliseconds, so a silent one is noticed in seconds, not after the client's default minute.
const CONTROL_RPC_TIMEOUT: Duration = Duration::from_secs(2);
/// How long node 0 waits for the other nodes to acknowledge a failure before it exits (and
/// its store goes); shorter when the failure is a frozen rank, whose node may be frozen too.
pub const SETTLE_PATIENCE: Duration = Duration::from_secs(10);
pub const SETTLE_PATIENCE_FROZEN: Duration = Duration::from_secs(2);

/// The flag that bounds every wait of the rendezvous, as the notices of long waits name it.
const LIMIT: &str = "--timeout";

fn control_options(node_rank: usize) -> ClientOptions {
    ClientOptions {
        rpc_timeout: CONTROL_RPC_TIMEOUT,
        caller: format!("oflaunch on node {node_rank}"),
        limit_name: LIMIT,
        ..ClientOptions::default()
    }
}

/// The node numbers at the end of `keys` (`.../<node>`).
fn nodes_of(keys: &[String]) -> Vec<usize> {
    keys.iter()
        .filter_map(|k| k.rsplit('/').next()?.parse().ok())
        .collect()
}

/// What a node knows about the job's shape.
#[derive(Debug, Clone)]
pub struct JoinSpec {
    pub master_addr: String,
    pub master_port: u16,
    pub nnodes: usize,
    pub node_rank: usize,
    pub nproc_per_node: usize,
    pub token: Option<String>,
    pub timeout: Duration,
    /// How long the store may stay silent while workers run before this node ends them (None:
    /// `min(--timeout, 15 s)`).
    pub stall_timeout: Option<Duration>,
    pub host: String,
}

/// This node's handle on the job's rendezvous.
pub struct Rendezvous {
    spec: JoinSpec,
    /// Node 0 only: the store (stops when dropped).
    _server: Option<StoreServer>,
    /// Multi-node only: this oflaunch's own connection to the store.
    client: Option<StoreClient>,
    /// `host:port` of the store.
    endpoint: String,
    pub port: u16,
    pub token: String,
}

impl Rendezvous {
    /// Node 0: binds the store. Other nodes: connect to it (retrying until `timeout`).
    pub fn start(spec: JoinSpec) -> Result<Rendezvous, LaunchError> {
        if spec.node_rank == 0 {
            let ip = resolve_ip(&spec.master_addr, spec.master_port)?;
            let token = match spec.token.clone() {
                Some(t) => t,
                None => generate_token()?,
            };
            let server = StoreServer::bind(SocketAddr::new(ip, spec.master_port), token.clone())
                .map_err(|e| {
                    LaunchError::Rendezvous(format!(
                        "node 0 cannot serve the store on {}:{}: {e}",
                        spec.master_addr, spec.master_port
                    ))
                })?;
            let port = server.local_addr().port();
            let endpoint = join_host_port(&spec.master_addr, port);
            tracing::info!("rendezvous store listening on {}", server.local_addr());
            let client = if spec.nnodes > 1 {
                Some(connect(&endpoint, &token, spec.timeout, 0)?)
            } else {
                None
            };
            Ok(Rendezvous {
                spec,
                _server: Some(server),
                client,
                endpoint,
                port,
                token,
            })
        } else {
            let token = spec.token.clone().ok_or_else(|| {
                LaunchError::Usage("node rank > 0 needs --token-file or OXIFLOW_TOKEN".into())
            })?;
            let endpoint = join_host_port(&spec.master_addr, spec.master_port);
            let client = connect(&endpoint, &token, spec.timeout, spec.node_rank)?;
            Ok(Rendezvous {
                port: spec.master_port,
                spec,
                _server: None,
                client: Some(client),
                endpoint,
                token,
            })
        }
    }

    /// A store handle for generation `generation` of the job (with its key prefix): this node's
    /// own client, or on a single node a new one to the store served here.
    pub fn job_store(&self, generation: u32) -> Option<StoreClient> {
        let client = match &self.client {
            Some(c) => c.clone(),
            None => StoreClient::connect_with(
                &self.endpoint,
                &self.token,
                Duration::from_secs(5),
                control_options(self.spec.node_rank),
            )
            .map_err(|e| tracing::warn!("cannot reach this node's own store: {e}"))
            .ok()?,
        };
        Some(client.with_prefix(&format!("job/g{generation}/")))
    }

    /// Checks that every node agrees on the job's shape and waits for all of them.
    pub fn join(&self) -> Result<(), LaunchError> {
        let Some(client) = &self.client else {
            return Ok(());
        };
        let s = &self.spec;
        let claims = client.add(&format!("oflaunch/claim/{}", s.node_rank), 1)?;
        if claims != 1 {
            return Err(LaunchError::Rendezvous(format!(
                "node rank {} is already taken by another oflaunch of this job",
                s.node_rank
            )));
        }
        let mine = format!("{} {} {}", s.nnodes, s.nproc_per_node, s.host);
        if s.node_rank == 0 {
            client.set("oflaunch/config", mine.as_bytes())?;
            self.judge_nodes(client)
        } else {
            let config = wait_string(client, "oflaunch/config", s, "to publish the job's shape")?;
            // Register even when our options differ, so node 0 can say so too.
            client.set(&format!("oflaunch/node/{}", s.node_rank), mine.as_bytes())?;
            let (nnodes, nproc) = parse_shape(&config).ok_or_else(|| {
                LaunchError::Rendezvous(format!("node 0 published a bad config {config:?}"))
            })?;
            if nnodes != s.nnodes || nproc != s.nproc_per_node {
                return Err(LaunchError::Rendezvous(format!(
                    "refused: node 0 runs --nnodes {nnodes} --nproc-per-node {nproc}, but this \
                     node (rank {}) has --nnodes {} --nproc-per-node {}; every node must use \
                     the same values",
                    s.node_rank, s.nnodes, s.nproc_per_node
                )));
            }
            let key = format!("oflaunch/verdict/{}", s.node_rank);
            let verdict = wait_string(
                client,
                &key,
                s,
                "to say whether the job may start (it waits until every node has joined)",
            )?;
            let _ = client.set(&format!("oflaunch/verdict_ack/{}", s.node_rank), b"1");
            if verdict == "ok" {
                Ok(())
            } else {
                Err(LaunchError::Rendezvous(verdict))
            }
        }
    }

    /// Node 0: waits for every node's registration and writes each one's verdict.
    fn judge_nodes(&self, client: &StoreClient) -> Result<(), LaunchError> {
        let s = &self.spec;
        let keys: Vec<String> = (1..s.nnodes)
            .map(|r| format!("oflaunch/node/{r}"))
            .collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let waited = client.wait_saying(&key_refs, s.timeout, LIMIT, |missing| {
            format!(
                "oflaunch on node 0: waiting for node(s) {:?} of {} to join at {}",
                nodes_of(missing),
                s.nnodes,
                self.endpoint
            )
        });
        if let Err(e) = waited {
            let mut missing = Vec::new();
            for (r, key) in (1..s.nnodes).zip(&keys) {
                if client.get(key).ok().flatten().is_none() {
                    missing.push(r);
                }
            }
            return Err(LaunchError::Rendezvous(format!(
                "timed out after {:?} waiting for node(s) {missing:?} to join at {} ({e}); a \
                 node with a wrong token or that cannot reach this address cannot join",
                s.timeout, self.endpoint
            )));
        }
        let mut problems = Vec::new();
        for (r, key) in (1..s.nnodes).zip(&keys) {
            let reg = get_string(client, key)?;
            match parse_shape(&reg) {
                Some((nnodes, nproc)) if nnodes == s.nnodes && nproc == s.nproc_per_node => {}
                Some((nnodes, nproc)) => problems.push(format!(
                    "node {r} ({}) brought --nnodes {nnodes} --nproc-per-node {nproc}, expected \
                     --nnodes {} --nproc-per-node {}",
                    reg.split(' ').nth(2).unwrap_or("?"),
                    s.nnodes,
                    s.nproc_per_node
                )),
                None => problems.push(format!("node {r} registered garbage {reg:?}")),
            }
        }
        let verdict = if problems.is_empty() {
            "ok".to_string()
        } else {
            format!("refused by node 0: {}", problems.join("; "))
        };
        for r in 1..s.nnodes {
            client.set(&format!("oflaunch/verdict/{r}"), verdict.as_bytes())?;
        }
        if problems.is_empty() {
            tracing::info!("all {} nodes joined", s.nnodes);
            return Ok(());
        }
        // Keep the store up until the refused nodes have read why (bounded).
        let acks: Vec<String> = (1..s.nnodes)
            .map(|r| format!("oflaunch/verdict_ack/{r}"))
            .collect();
        let refs: Vec<&str> = acks.iter().map(String::as_str).collect();
        let _ = client.wait(&refs, Duration::from_secs(5));
        Err(LaunchError::Rendezvous(verdict))
    }

    /// Starts polling `failed/g<generation>` (multi-node only). On nodes other than 0, a store
    /// that does not answer for the stall timeout (else `min(--timeout, 15 s)`) is reported as
    /// lost; node 0's is its own, so a call of its that failed only says this process was
    /// paused, and it polls on.
    pub fn watch_failures(&self, generation: u32) -> Result<FailureWatch, LaunchError> {
        let seen = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        if let Some(client) = self.client.clone() {
            let key = failed_key(generation);
            let ack = format!("oflaunch/failack/g{generation}/{}", self.spec.node_rank);
            let lost_after = match self.spec.node_rank {
                0 => Duration::MAX,
                _ => self
                    .spec
                    .stall_timeout
                    .unwrap_or_else(|| self.spec.timeout.min(Duration::from_secs(15))),
            };
            let where_ = format!(
                "the rendezvous store at {} (served by node 0, where ranks 0-{} run)",
                self.endpoint,
                self.spec.nproc_per_node.saturating_sub(1)
            );
            let (seen2, stop2) = (seen.clone(), stop.clone());
            std::thread::Builder::new()
                .name("oflaunch-failwatch".into())
                .spawn(move || {
                    let mut last_answer = Instant::now();
                    let event = loop {
                        if stop2.load(Ordering::Relaxed) {
                            return;
                        }
                        match client.wait(&[key.as_str()], POLL) {
                            Ok(v) => {
                                let _ = client.set(&ack, b"1");
                                let text =
                                    String::from_utf8_lossy(v.first().map_or(&[][..], |v| v));
                                match Failure::decode(&text) {
                                    Some(f) => break RemoteEvent::Failed(f),
                                    None => {
                                        break RemoteEvent::StoreLost {
                                            message: format!(
                                                "unreadable failure report {text:?} in the store"
                                            ),
                                            last_answer: Instant::now(),
                                        }
                                    }
                                }
                            }
                            // The store answered: the key is not there yet.
                            Err(CommError::StoreTimeout { .. }) => last_answer = Instant::now(),
                            Err(e) => {
                                let silent = last_answer.elapsed();
                                if silent >= lost_after {
                                    break RemoteEvent::StoreLost {
                                        message: format!(
                                            "{where_} has not answered for {:.1} s (node 0 is \
                                             frozen or gone): {e}",
                                            silent.as_secs_f64()
                                        ),
                                        last_answer,
                                    };
                                }
                                std::thread::sleep(POLL.min(lost_after.saturating_sub(silent)));
                            }
                        }
                    };
                    if let Ok(mut slot) = seen2.lock() {
                        *slot = Some(event);
                    }
                })
                .map_err(|e| LaunchError::io("starting the failure watcher", e))?;
        }
        Ok(FailureWatch { seen, stop })
    }

    /// After a failure ends the job: records that this node saw it; node 0 then waits (at most
    /// `patience`) until every node has, so none of them finds the store gone instead.
    pub fn settle_failure(&self, generation: u32, patience: Duration) {
        let Some(client) = &self.client else { return };
        let s = &self.spec;
        let _ = client.set(
            &format!("oflaunch/failack/g{generation}/{}", s.node_rank),
            b"1",
        );
        if s.node_rank == 0 {
            let keys: Vec<String> = (0..s.nnodes)
                .map(|r| format!("oflaunch/failack/g{generation}/{r}"))
                .collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            if let Err(e) = client.wait(&refs, patience) {
                tracing::warn!("not every node acknowledged the failure: {e}");
            }
        }
    }

    /// Publishes this node's first failure of `generation` (the first node to report wins).
    pub fn report_failure(&self, generation: u32, failure: &Failure) {
        let Some(client) = &self.client else { return };
        let first = client.add(&format!("oflaunch/failcount/g{generation}"), 1);
        if matches!(first, Ok(1)) {
            if let Err(e) = client.set(&failed_key(generation), failure.encode().as_bytes()) {
                tracing::error!("could not tell the other nodes about the failure: {e}");
            }
        }
    }

    /// Waits for every node before restarting generation `generation + 1`.
    pub fn restart_barrier(&self, generation: u32) -> Result<(), LaunchError> {
        let Some(client) = &self.client else {
            return Ok(());
        };
        let s = &self.spec;
        client.set(
            &format!("oflaunch/restart/g{generation}/{}", s.node_rank),
            b"1",
        )?;
        let keys: Vec<String> = (0..s.nnodes)
            .map(|r| format!("oflaunch/restart/g{generation}/{r}"))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        client.wait_saying(&refs, s.timeout, LIMIT, |missing| {
            format!(
                "oflaunch on node {}: waiting for node(s) {:?} to stop their workers before \
                 the restart",
                s.node_rank,
                nodes_of(missing)
            )
        })?;
        Ok(())
    }

    /// After this node's workers all succeeded: records it; node 0 then keeps the store up
    /// until every node is done, and returns a failure another node reported meanwhile. A node
    /// other than 0 retries until the store takes the news (node 0 frozen: up to `--timeout`),
    /// so both agree on the job's end; if node 0 is gone (nothing listens at its address) or
    /// does not answer within `--timeout`, it still succeeds (its work is done) and says that
    /// it could not report.
    pub fn finish(&self, generation: u32) -> Result<Option<Failure>, LaunchError> {
        let Some(client) = &self.client else {
            return Ok(None);
        };
        let s = &self.spec;
        let done_key = format!("oflaunch/done/{}", s.node_rank);
        if s.node_rank != 0 {
            self.report_done(client, &done_key);
            return Ok(None);
        }
        let keys: Vec<String> = (0..s.nnodes)
            .map(|r| format!("oflaunch/done/{r}"))
            .collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let failed = failed_key(generation);
        let deadline = Instant::now() + s.timeout;
        let mut notice = LongWait::new(s.timeout, LIMIT);
        let mut said_done = false;
        // The store is this process's own: a call that fails did so because this process was
        // paused (SIGSTOP) past its deadline, so it is tried again until --timeout.
        loop {
            said_done = said_done || client.set(&done_key, b"1").is_ok();
            if said_done {
                match client.wait(&key_refs, POLL) {
                    Ok(_) => return Ok(None),
                    Err(CommError::StoreTimeout { missing_keys, .. }) => notice.tick(|| {
                        format!(
                            "oflaunch on node 0: this node's workers finished; waiting for \
                             node(s) {:?} to report theirs",
                            nodes_of(&missing_keys)
                        )
                    }),
                    Err(_) => std::thread::sleep(POLL),
                }
            }
            if let Ok(Some(v)) = client.get(&failed) {
                return Ok(Failure::decode(&String::from_utf8_lossy(&v)));
            }
            if Instant::now() >= deadline {
                return Err(LaunchError::Rendezvous(format!(
                    "this node's workers finished, but other nodes did not report done within \
                     {:?}",
                    s.timeout
                )));
            }
        }
    }

    /// A node other than 0: sets `done_key`, retrying while node 0's store does not answer
    /// (see `finish`).
    fn report_done(&self, client: &StoreClient, done_key: &str) {
        let s = &self.spec;
        let deadline = Instant::now() + s.timeout;
        let mut notice = LongWait::new(s.timeout, LIMIT);
        loop {
            let e = match client.set(done_key, b"1") {
                Ok(()) => return,
                Err(e) => e,
            };
            if nobody_listens(&self.endpoint) {
                // A request that timed out may still have been taken before node 0 ended.
                tracing::warn!(
                    "this node's workers all finished; the store at {} is gone (nothing listens \
                     there: node 0 has ended) without confirming that it took the news ({e}); if \
                     it did not, node 0 reported a failure",
                    self.endpoint
                );
                return;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    "this node's workers all finished, but the store at {} did not take the \
                     news within --timeout {:?} ({e}); node 0 cannot know that this node \
                     succeeded",
                    self.endpoint,
                    s.timeout
                );
                return;
            }
            notice.tick(|| {
                format!(
                    "oflaunch on node {}: this node's workers all finished; waiting for node \
                     0's store at {} to take the news (node 0 frozen?): {e}",
                    s.node_rank, self.endpoint
                )
            });
            std::thread::sleep(POLL);
        }
    }
}

/// Whether nothing accepts connections at `endpoint` any more (a frozen process's socket still
/// does: the kernel completes the handshake).
fn nobody_listens(endpoint: &str) -> bool {
    let Some(addr) = endpoint.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return false;
    };
    matches!(
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// A running poll of the store's failure key.
pub struct FailureWatch {
    seen: Arc<Mutex<Option<RemoteEvent>>>,
    stop: Arc<AtomicBool>,
}

/// What the failure watcher learned from the store.
#[derive(Debug, Clone)]
pub enum RemoteEvent {
    /// Another node (or this one) published the generation's first failure.
    Failed(Failure),
    /// The store could not be reached for too long (it last answered at `last_answer`).
    StoreLost {
        message: String,
        last_answer: Instant,
    },
}

impl FailureWatch {
    pub fn event(&self) -> Option<RemoteEvent> {
        self.seen.lock().ok().and_then(|s| s.clone())
    }
}

impl Drop for FailureWatch {
    fn drop(&mut self) {
        // The thread notices within one poll and exits.
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn failed_key(generation: u32) -> String {
    format!("oflaunch/failed/g{generation}")
}

fn parse_shape(s: &str) -> Option<(usize, usize)> {
    let mut it = s.split(' ');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

fn get_string(client: &StoreClient, key: &str) -> Result<String, LaunchError> {
    match client.get(key)? {
        Some(v) => Ok(String::from_utf8_lossy(&v).into_owned()),
        None => Err(LaunchError::Rendezvous(format!("store key {key} vanished"))),
    }
}

/// Waits for node 0's `key` (up to `--timeout`), saying every 10 s that node 0 has yet `to`
/// do what sets it.
fn wait_string(
    client: &StoreClient,
    key: &str,
    s: &JoinSpec,
    to: &str,
) -> Result<String, LaunchError> {
    let values = client
        .wait_saying(&[key], s.timeout, LIMIT, |_| {
            format!(
                "oflaunch on node {}: waiting for node 0 {to} ({key})",
                s.node_rank
            )
        })
        .map_err(|e| {
            LaunchError::Rendezvous(format!("waiting {:?} for node 0's {key}: {e}", s.timeout))
        })?;
    let v = values.into_iter().next().unwrap_or_default();
    Ok(String::from_utf8_lossy(&v).into_owned())
}

fn resolve_ip(addr: &str, port: u16) -> Result<std::net::IpAddr, LaunchError> {
    (addr, port)
        .to_socket_addrs()
        .map_err(|e| LaunchError::io(format!("resolving --master-addr {addr}"), e))?
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| LaunchError::Usage(format!("--master-addr {addr} resolves to nothing")))
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Connects to the store (the client retries until `timeout` while it is not up yet); a
/// refused token fails at once.
fn connect(
    endpoint: &str,
    token: &str,
    timeout: Duration,
    node_rank: usize,
) -> Result<StoreClient, LaunchError> {
    match StoreClient::connect_with(endpoint, token, timeout, control_options(node_rank)) {
        Ok(c) => Ok(c),
        Err(CommError::Unauthenticated(m)) => Err(LaunchError::Rendezvous(format!(
            "refused: the store at {endpoint} rejected this node's token ({m}); pass node 0's \
             token with --token-file or OXIFLOW_TOKEN"
        ))),
        Err(e) => Err(LaunchError::Rendezvous(format!(
            "cannot reach the store at {endpoint} within {timeout:?}: {e}"
        ))),
    }
}
