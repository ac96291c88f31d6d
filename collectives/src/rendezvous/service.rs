//! The gRPC face of the store: request validation against the limits, the token interceptor,
//! and the tonic `Store` service over `StoreState`.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::admission::StoreConnectInfo;
use super::config::{check_key, check_value, constant_time_eq};
use super::proto;
use super::refusals::RefusalLog;
use super::state::{StoreState, WaitOutcome};
use super::TOKEN_METADATA_KEY;

/// Protocol version reported by `Ping`.
pub(crate) const PROTOCOL_VERSION: u32 = 1;

/// Refuses every request whose `x-oxiflow-token` metadata differs from the job's token, and
/// admits the connection of every request that carries it.
#[derive(Clone)]
pub(crate) struct TokenCheck {
    token: Arc<[u8]>,
    refusals: Arc<RefusalLog>,
}

impl TokenCheck {
    pub fn new(token: &str) -> TokenCheck {
        TokenCheck {
            token: Arc::from(token.as_bytes()),
            refusals: Arc::new(RefusalLog::new(
                "rendezvous store refused requests with a wrong or missing token",
            )),
        }
    }
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let ok = request
            .metadata()
            .get(TOKEN_METADATA_KEY)
            .is_some_and(|v| constant_time_eq(v.as_bytes(), &self.token));
        let conn = request.extensions().get::<StoreConnectInfo>();
        if ok {
            if let Some(conn) = conn {
                conn.ticket.authenticate();
            }
            Ok(request)
        } else {
            let peer = conn.map_or_else(|| "unknown peer".to_string(), StoreConnectInfo::peer);
            tracing::debug!(%peer, "rendezvous store refused a request with a wrong or missing token");
            if let Some(ip) = conn.and_then(|c| c.tcp.remote_addr()).map(|a| a.ip()) {
                self.refusals.record(ip);
            }
            Err(Status::unauthenticated(
                "rendezvous store: wrong or missing token (every rank must carry the job's token, \
                 OXIFLOW_TOKEN, which oflaunch sets)",
            ))
        }
    }
}

/// The `Store` service.
pub(crate) struct StoreService {
    state: Arc<StoreState>,
}

impl StoreService {
    pub fn new(state: Arc<StoreState>) -> StoreService {
        StoreService { state }
    }

    fn key(&self, op: &str, key: &str) -> Result<(), Status> {
        check_key(op, key, self.state.config().max_key_bytes).map_err(Status::invalid_argument)
    }

    fn value(&self, op: &str, key: &str, len: usize) -> Result<(), Status> {
        check_value(op, key, len, self.state.config().max_value_bytes)
            .map_err(Status::invalid_argument)
    }

    /// The deadline of a wait: the requested timeout, capped by the server's `max_wait`.
    fn deadline(&self, timeout_ms: u64) -> Instant {
        let asked = Duration::from_millis(timeout_ms);
        Instant::now() + asked.min(self.state.config().max_wait)
    }
}

#[tonic::async_trait]
impl proto::store_server::Store for StoreService {
    async fn ping(
        &self,
        _request: Request<proto::PingRequest>,
    ) -> Result<Response<proto::PingResponse>, Status> {
        let config = self.state.config();
        Ok(Response::new(proto::PingResponse {
            protocol_version: PROTOCOL_VERSION,
            max_message_bytes: config.max_message_bytes as u64,
            max_wait_ms: u64::try_from(config.max_wait.as_millis()).unwrap_or(u64::MAX),
        }))
    }

    async fn set(
        &self,
        request: Request<proto::SetRequest>,
    ) -> Result<Response<proto::SetResponse>, Status> {
        let req = request.into_inner();
        self.key("set", &req.key)?;
        self.value("set", &req.key, req.value.len())?;
        self.state.set(&req.key, req.value)?;
        Ok(Response::new(proto::SetResponse {}))
    }

    async fn get(
        &self,
        request: Request<proto::GetRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        let req = request.into_inner();
        self.key("get", &req.key)?;
        let value = self.state.get(&req.key);
        Ok(Response::new(proto::GetResponse {
            found: value.is_some(),
            value: value.unwrap_or_default(),
        }))
    }

    async fn wait(
        &self,
        request: Request<proto::WaitRequest>,
    ) -> Result<Response<proto::WaitResponse>, Status> {
        let req = request.into_inner();
        let max_keys = self.state.config().max_keys_per_wait;
        if req.keys.len() > max_keys {
            return Err(Status::invalid_argument(format!(
                "wait: {} keys exceed the limit of {max_keys} keys per wait",
                req.keys.len()
            )));
        }
        for key in &req.keys {
            self.key("wait", key)?;
        }
        let deadline = self.deadline(req.timeout_ms);
        let response = match self.state.wait(&req.keys, deadline).await? {
            WaitOutcome::Done(values) => {
                let total: usize = values.iter().map(Vec::len).sum();
                let cap = self.state.config().max_message_bytes;
                if total > cap.saturating_sub(4096) {
                    return Err(Status::resource_exhausted(format!(
                        "wait: the {} values total {total} bytes, more than one message of {cap} bytes \
                         can carry; wait for fewer keys at once",
                        values.len()
                    )));
                }
                proto::WaitResponse {
                    done: true,
                    values,
                    missing: Vec::new(),
                }
            }
            WaitOutcome::Missing(missing) => proto::WaitResponse {
                done: false,
                values: Vec::new(),
                missing,
            },
        };
        Ok(Response::new(response))
    }

    async fn add(
        &self,
        request: Request<proto::AddRequest>,
    ) -> Result<Response<proto::AddResponse>, Status> {
        let req = request.into_inner();
        self.key("add", &req.key)?;
        let value = self.state.add(&req.key, req.delta)?;
        Ok(Response::new(proto::AddResponse { value }))
    }

    async fn delete(
        &self,
        request: Request<proto::DeleteRequest>,
    ) -> Result<Response<proto::DeleteResponse>, Status> {
        let req = request.into_inner();
        self.key("delete", &req.key)?;
        Ok(Response::new(proto::DeleteResponse {
            existed: self.state.delete(&req.key),
        }))
    }

    async fn barrier(
        &self,
        request: Request<proto::BarrierRequest>,
    ) -> Result<Response<proto::BarrierResponse>, Status> {
        let req = request.into_inner();
        self.key("barrier", &req.name)?;
        if req.n == 0 {
            return Err(Status::invalid_argument(format!(
                "barrier {:?}: n must be positive",
                req.name
            )));
        }
        if req.arrival_id.is_empty() || req.arrival_id.len() > 128 {
            return Err(Status::invalid_argument(format!(
                "barrier {:?}: arrival id must have 1..=128 bytes",
                req.name
            )));
        }
        let rank = req.has_rank.then_some(req.rank);
        let deadline = self.deadline(req.timeout_ms);
        let out = self
            .state
            .barrier(&req.name, req.n, &req.arrival_id, rank, deadline)
            .await?;
        Ok(Response::new(proto::BarrierResponse {
            done: out.done,
            arrived: out.arrived,
            arrived_ranks: out.arrived_ranks,
        }))
    }

    async fn compare_set(
        &self,
        request: Request<proto::CompareSetRequest>,
    ) -> Result<Response<proto::CompareSetResponse>, Status> {
        let req = request.into_inner();
        self.key("compare_set", &req.key)?;
        self.value("compare_set", &req.key, req.desired.len())?;
        let expected = (!req.expected_absent).then_some(req.expected.as_slice());
        let out = self.state.compare_set(&req.key, expected, req.desired)?;
        Ok(Response::new(proto::CompareSetResponse {
            swapped: out.swapped,
            found: out.value.is_some(),
            value: out.value.unwrap_or_default(),
        }))
    }
}
