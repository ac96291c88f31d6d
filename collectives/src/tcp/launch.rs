//! `init_world`: from the launch environment to a connected CPU world. Rank 0 serves the
//! rendezvous store at MASTER_ADDR:MASTER_PORT unless something (oflaunch) already does.

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use super::TcpComm;
use crate::env::{BackendChoice, LaunchEnv};
use crate::rendezvous::{StoreClient, StoreServer};
use crate::{CommError, SharedComm};

/// The local address from which this host reaches `master` (no packet is sent).
fn local_host_towards(master: SocketAddr) -> String {
    if master.ip().is_loopback() {
        return master.ip().to_string();
    }
    let bind: SocketAddr = if master.is_ipv4() {
        "0.0.0.0:0".parse().unwrap_or(master)
    } else {
        "[::]:0".parse().unwrap_or(master)
    };
    UdpSocket::bind(bind)
        .and_then(|s| s.connect(master).and_then(|()| s.local_addr()))
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| master.ip().to_string())
}

/// Connects this process to the world described by `env` over the CPU (TCP) backend.
pub fn init_world(env: &LaunchEnv) -> Result<SharedComm, CommError> {
    if env.backend == BackendChoice::Nccl {
        return Err(CommError::Unsupported {
            op: "init_world".into(),
            backend: "cpu".into(),
            detail: "OXIFLOW_BACKEND=nccl asks for the NCCL backend; this builds the CPU world"
                .into(),
        });
    }
    env.configure_flight_recorder();
    if env.world_size <= 1 {
        return TcpComm::connect_serving_solo(env.timeout);
    }
    let token = env.token.as_deref().ok_or_else(|| {
        CommError::Env(format!(
            "OXIFLOW_TOKEN is required for a world of {} ranks (oflaunch sets it)",
            env.world_size
        ))
    })?;
    let addr = env.store_addr();
    let master: SocketAddr = addr
        .to_socket_addrs()
        .map_err(|source| CommError::Io {
            context: format!("init_world: resolve MASTER_ADDR:MASTER_PORT {addr}"),
            source,
        })?
        .next()
        .ok_or_else(|| {
            CommError::Env(format!(
                "MASTER_ADDR:MASTER_PORT {addr} resolves to no address"
            ))
        })?;
    let mut server = None;
    if env.rank == 0 {
        match StoreServer::bind(master, token.to_string()) {
            Ok(s) => server = Some(s),
            // In use: a launcher serves the store; connect to it below.
            Err(CommError::Io { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {
            }
            Err(e) => return Err(e),
        }
    }
    let store = StoreClient::connect(&addr, token, env.timeout)?.with_prefix(&env.store_prefix);
    let host = local_host_towards(master);
    TcpComm::connect_serving(
        &store,
        env.rank,
        env.world_size,
        &host,
        env.timeout,
        env.shm,
        server,
    )
}

impl TcpComm {
    fn connect_serving_solo(timeout: Duration) -> Result<SharedComm, CommError> {
        Ok(TcpComm::from_streams(vec![None], 0, timeout, None, None))
    }
}
