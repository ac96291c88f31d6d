//! The MPI runtime of a process: initialised once (thread level `Multiple`), finalised at
//! process exit, a watchdog that ends a job whose call outlives the timeout, and the bootstrap
//! of the TCP world's rendezvous through MPI when the launcher gave no MASTER_ADDR/MASTER_PORT.

use std::net::ToSocketAddrs;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use ::mpi::Threading;

use crate::env::LaunchEnv;
use crate::rendezvous::{generate_token, StoreServer};
use crate::CommError;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The universe rsmpi hands out on initialisation; dropping it finalises MPI.
static UNIVERSE: Mutex<Option<::mpi::environment::Universe>> = Mutex::new(None);

extern "C" fn finalize_at_exit() {
    // Communicators still alive at exit are leaked rather than freed (see `CommHandle`).
    drop(lock(&UNIVERSE).take());
}

/// Initialises MPI for this process (once; later calls return at once).
pub(crate) fn ensure_initialized() -> Result<(), CommError> {
    let mut slot = lock(&UNIVERSE);
    if slot.is_some() || ::mpi::environment::is_initialized() {
        return Ok(());
    }
    let (universe, provided) =
        ::mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| {
            CommError::Device("MPI_Init_thread: MPI was already initialised elsewhere".into())
        })?;
    if provided != Threading::Multiple {
        tracing::warn!(
            "MPI provides thread level {provided:?}, not Multiple: a hung call ends the process \
             with abort() instead of MPI_Abort"
        );
    }
    *slot = Some(universe);
    // SAFETY: registers a plain `extern "C"` function with no arguments, as atexit requires.
    if unsafe { libc::atexit(finalize_at_exit) } != 0 {
        tracing::warn!("MPI: could not register MPI_Finalize at exit");
    }
    Ok(())
}

/// The call one MPI world is in, for the watchdog.
#[derive(Default)]
struct Busy {
    call: Option<(Instant, String)>,
}

/// Serialises the MPI calls of one world and ends the job when one outlives `timeout`: MPI
/// cannot cancel a collective that may still write the caller's buffer, so the watchdog dumps
/// the flight recorder (when a dump directory is set), names the call, and calls `MPI_Abort`.
pub(crate) struct Watchdog {
    calls: Mutex<()>,
    busy: Arc<Mutex<Busy>>,
}

/// Held for the duration of one MPI call.
pub(crate) struct InCall<'a> {
    _calls: MutexGuard<'a, ()>,
    busy: &'a Mutex<Busy>,
}

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        lock(self.busy).call = None;
    }
}

impl Watchdog {
    pub(crate) fn start(timeout: Duration) -> Result<Arc<Watchdog>, CommError> {
        let busy = Arc::new(Mutex::new(Busy::default()));
        let watched = Arc::downgrade(&busy);
        std::thread::Builder::new()
            .name("mpi-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100));
                let Some(busy) = watched.upgrade() else {
                    return;
                };
                let overdue = match &lock(&busy).call {
                    Some((t, what)) if t.elapsed() > timeout => Some(what.clone()),
                    _ => None,
                };
                if let Some(what) = overdue {
                    abort_job(&what, timeout);
                }
            })
            .map_err(|source| CommError::Io {
                context: "mpi: starting the watchdog thread".into(),
                source,
            })?;
        Ok(Arc::new(Watchdog {
            calls: Mutex::new(()),
            busy,
        }))
    }

    /// Enters an MPI call named `what` (e.g. "all_reduce on ranks [0, 1]").
    pub(crate) fn enter(&self, what: impl FnOnce() -> String) -> InCall<'_> {
        let calls = lock(&self.calls);
        lock(&self.busy).call = Some((Instant::now(), what()));
        InCall {
            _calls: calls,
            busy: &self.busy,
        }
    }
}

fn abort_job(what: &str, timeout: Duration) -> ! {
    let recorder = crate::flight_recorder();
    eprintln!(
        "oxiflow mpi: rank {}: {what} did not finish within {timeout:?}; aborting the MPI job",
        recorder.rank()
    );
    if let Some(dir) = recorder.dump_dir() {
        match recorder.dump(&dir) {
            Ok(p) => eprintln!("oxiflow mpi: flight recorder written to {}", p.display()),
            Err(e) => eprintln!("oxiflow mpi: {e}"),
        }
    }
    if ::mpi::environment::threading_support() == Threading::Multiple {
        SimpleCommunicator::world().abort(124)
    }
    std::process::abort()
}

/// Where the TCP world meets, as rank 0 chose it and broadcast it.
pub(crate) struct Rendezvous {
    pub addr: String,
    pub token: String,
    pub server: Option<StoreServer>,
}

/// Rank 0 serves the store (at MASTER_ADDR:MASTER_PORT when given, else on an ephemeral port
/// of 127.0.0.1, or of this host's address when the ranks span several hosts) with the given or
/// a fresh token, and broadcasts address and token through `MPI_COMM_WORLD`. Every rank gets
/// the same result, a failure at rank 0 included.
pub(crate) fn bootstrap_rendezvous(env: &LaunchEnv) -> Result<Rendezvous, CommError> {
    ensure_initialized()?;
    let world = SimpleCommunicator::world();
    let root = world.process_at_rank(0);
    let mut server = None;
    let mut message = Vec::new();
    if world.rank() == 0 {
        let served = serve(env).map(|(s, token)| {
            let addr = s.local_addr().to_string();
            server = Some(s);
            (addr, token)
        });
        message = match served {
            Ok((addr, token)) => format!("ok\n{addr}\n{token}").into_bytes(),
            Err(e) => format!("error\n{e}").into_bytes(),
        };
    }
    let mut len = [u64::try_from(message.len()).unwrap_or(0)];
    root.broadcast_into(&mut len[..]);
    let len =
        usize::try_from(len[0]).map_err(|_| CommError::Rendezvous("mpi: bad length".into()))?;
    if len > 64 << 10 {
        return Err(CommError::Rendezvous(format!(
            "mpi bootstrap: rank 0 sent a {len}-byte rendezvous message"
        )));
    }
    message.resize(len, 0);
    root.broadcast_into(&mut message[..]);
    let text = String::from_utf8_lossy(&message).into_owned();
    let mut parts = text.splitn(3, '\n');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("ok"), Some(addr), Some(token)) => Ok(Rendezvous {
            addr: addr.to_string(),
            token: token.to_string(),
            server,
        }),
        (Some("error"), Some(e), _) => Err(CommError::Rendezvous(format!(
            "mpi bootstrap: rank 0 could not serve the store: {e}"
        ))),
        _ => Err(CommError::Rendezvous(
            "mpi bootstrap: malformed message from rank 0".into(),
        )),
    }
}

/// Rank 0's store for the bootstrap, and the token.
fn serve(env: &LaunchEnv) -> Result<(StoreServer, String), CommError> {
    let token = match &env.token {
        Some(t) => t.clone(),
        None => generate_token()?,
    };
    let host = if !env.master_addr.is_empty() {
        env.master_addr.clone()
    } else if env.local_world_size == env.world_size {
        "127.0.0.1".to_string()
    } else {
        this_host_address()?
    };
    let addr = crate::tcp::mesh::resolve(
        (host.as_str(), env.master_port),
        format!("mpi bootstrap: resolve {host}"),
        || CommError::Env(format!("mpi bootstrap: {host} resolves to no address")),
    )?;
    Ok((StoreServer::bind(addr, token.clone())?, token))
}

/// This host's address as its name resolves (ranks on other hosts connect to it).
fn this_host_address() -> Result<String, CommError> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    (name.as_str(), 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|a| !a.ip().is_loopback()))
        .map(|a| a.ip().to_string())
        .ok_or_else(|| {
            CommError::Env(format!(
                "MASTER_ADDR is missing and this host's name {name:?} does not resolve to a \
                 non-loopback address: export MASTER_ADDR (an address of rank 0's host) to every rank"
            ))
        })
}
