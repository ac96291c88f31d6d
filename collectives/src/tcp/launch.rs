//! `init_world`: from the launch environment to a connected CPU world. Rank 0 serves the
//! rendezvous store at MASTER_ADDR:MASTER_PORT unless something (oflaunch) already does; under
//! an MPI launcher without MASTER_ADDR/MASTER_PORT/OXIFLOW_TOKEN, rank 0 serves it where it
//! can and tells the others through MPI (feature `mpi`). `OXIFLOW_BACKEND=mpi` builds the MPI
//! world instead.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use super::TcpComm;
use crate::env::{BackendChoice, CpuPlane, LaunchEnv};
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
    if env.cpu_plane == CpuPlane::Mpi {
        return mpi_world(env);
    }
    if env.world_size <= 1 {
        return TcpComm::connect_serving_solo(env.timeout);
    }
    if env.needs_mpi_bootstrap() {
        return connect_through_mpi(env);
    }
    let token = env.token.as_deref().ok_or_else(|| {
        CommError::Env(format!(
            "OXIFLOW_TOKEN is required for a world of {} ranks (oflaunch sets it)",
            env.world_size
        ))
    })?;
    let addr = env.store_addr();
    let master = super::mesh::resolve(
        addr.as_str(),
        format!("init_world: resolve MASTER_ADDR:MASTER_PORT {addr}"),
        || {
            CommError::Env(format!(
                "MASTER_ADDR:MASTER_PORT {addr} resolves to no address"
            ))
        },
    )?;
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
    let store = StoreClient::connect_with(&addr, token, env.timeout, env.store_options())
        .map_err(|e| match e {
            CommError::Unauthenticated(m) => CommError::Unauthenticated(format!(
                "rank {} of {}: the store at {addr} refused this rank's OXIFLOW_TOKEN ({m}); \
                 every rank needs the job's token",
                env.rank, env.world_size
            )),
            other => other,
        })?
        .with_prefix(&env.store_prefix);
    tcp_world(env, &store, master, server)
}

/// The TCP world of `env` through `store`, this rank reachable at its address towards
/// `master`; `server` is the store this rank serves, if any.
fn tcp_world(
    env: &LaunchEnv,
    store: &StoreClient,
    master: SocketAddr,
    server: Option<StoreServer>,
) -> Result<SharedComm, CommError> {
    let host = local_host_towards(master);
    TcpComm::connect_serving(
        store,
        env.rank,
        env.world_size,
        &host,
        env.timeout,
        env.shm,
        server,
    )
}

#[cfg(feature = "mpi")]
fn mpi_world(env: &LaunchEnv) -> Result<SharedComm, CommError> {
    crate::mpi::init_world_mpi(env)
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(_env: &LaunchEnv) -> Result<SharedComm, CommError> {
    Err(CommError::Unsupported {
        op: "init_world".into(),
        backend: "mpi".into(),
        detail: "OXIFLOW_BACKEND=mpi, but this build has no MPI support: rebuild with \
                 `cargo build --release --features mpi` (needs an MPI installation)"
            .into(),
    })
}

/// The TCP world, its store's address and token told by rank 0 through MPI.
#[cfg(feature = "mpi")]
fn connect_through_mpi(env: &LaunchEnv) -> Result<SharedComm, CommError> {
    let rv = crate::mpi::bootstrap_rendezvous(env)?;
    let master: SocketAddr = rv.addr.parse().map_err(|_| {
        CommError::Rendezvous(format!("mpi bootstrap: bad store address {:?}", rv.addr))
    })?;
    let store = StoreClient::connect_with(&rv.addr, &rv.token, env.timeout, env.store_options())?
        .with_prefix(&env.store_prefix);
    tcp_world(env, &store, master, rv.server)
}

/// Without MPI support nothing can tell the ranks where the store is.
#[cfg(not(feature = "mpi"))]
fn connect_through_mpi(env: &LaunchEnv) -> Result<SharedComm, CommError> {
    let missing: Vec<&str> = [
        ("MASTER_ADDR", env.master_addr.is_empty()),
        ("MASTER_PORT", env.master_port == 0),
        ("OXIFLOW_TOKEN", env.token.is_none()),
    ]
    .iter()
    .filter(|(_, m)| *m)
    .map(|(n, _)| *n)
    .collect();
    Err(CommError::Env(format!(
        "started by an MPI launcher ({} ranks) without {}: this build has no MPI support to \
         bootstrap the rendezvous through MPI. Rebuild with `--features mpi`, or export \
         MASTER_ADDR, MASTER_PORT and OXIFLOW_TOKEN to every rank (e.g. mpirun -x ...)",
        env.world_size,
        missing.join(", ")
    )))
}

impl TcpComm {
    fn connect_serving_solo(timeout: Duration) -> Result<SharedComm, CommError> {
        Ok(TcpComm::from_streams(
            vec![None],
            0,
            timeout,
            None,
            None,
            None,
        ))
    }
}
