//! Building the world communicator from the launch contract: `nccl` explicitly, or `auto`
//! (NCCL when the CUDA driver, NCCL and one GPU per local rank are present, else the CPU world).

use std::sync::Arc;

use super::comm::{NcclComm, NcclOptions};
use crate::cuda_libs::{self, LibSearch};
use crate::env::{BackendChoice, LaunchEnv};
use crate::heartbeat;
use crate::rendezvous::{self, DeviceSeat};
use crate::{CommError, SharedComm};

/// Why `auto` would not pick NCCL on this machine (`None`: it would).
pub fn nccl_unavailable(env: &LaunchEnv, libs: &LibSearch) -> Option<String> {
    match cuda_libs::probe(libs).nccl_ready() {
        Err(reason) => Some(reason),
        Ok(n) if n < env.local_world_size => Some(format!(
            "{n} CUDA device(s) for {} local ranks",
            env.local_world_size
        )),
        Ok(_) => None,
    }
}

/// The NCCL world: rank `env.rank` on device `env.device_ordinal()`, bootstrapped through the job's
/// rendezvous store (`MASTER_ADDR:MASTER_PORT`, `OXIFLOW_TOKEN`).
pub fn init_world_nccl(env: &LaunchEnv, libs: &LibSearch) -> Result<NcclComm, CommError> {
    env.configure_flight_recorder();
    let mut libs = libs.clone();
    libs.extra_dirs.extend(env.cuda_lib_dirs.iter().cloned());
    let seat = seat_of(env, &libs);
    if let (1, Err(why)) = (env.world_size, &seat.device) {
        return Err(CommError::Device(format!(
            "rank 0 cannot start NCCL: {why}"
        )));
    }
    let store = env.connect_store()?;
    if env.world_size > 1 {
        // The same membership checks as the CPU world (world size, duplicate rank) and the
        // device seat, so a mismatch, a missing library or two ranks on one GPU is the same
        // clear error on every rank at rendezvous, before any NCCL call.
        let who = format!(
            "pid {} on CUDA device {}",
            std::process::id(),
            env.device_ordinal()
        );
        rendezvous::join_world_seated(
            &store,
            env.rank,
            env.world_size,
            &who,
            env.timeout,
            Some(&seat),
        )?;
    }
    let opts = NcclOptions {
        timeout: env.timeout,
        libs,
        ..NcclOptions::default()
    };
    let comm = NcclComm::init_with(
        Arc::new(store.clone()),
        env.rank,
        env.world_size,
        env.device_ordinal(),
        &opts,
    )?;
    if env.world_size > 1 {
        comm.keep_heartbeat(heartbeat::start(store, env.rank));
    }
    Ok(comm)
}

/// This rank's device: its ordinal when CUDA, NCCL and that device are there, else why not.
fn seat_of(env: &LaunchEnv, libs: &LibSearch) -> DeviceSeat {
    DeviceSeat::for_rank(
        crate::shm::host_id(),
        env.device_ordinal(),
        cuda_libs::probe(libs).nccl_ready(),
        env.local_world_size,
    )
}

/// `--backend nccl|cpu|auto`: NCCL when asked (an error if it cannot start), the CPU world
/// when asked, and for `auto` NCCL when [`nccl_unavailable`] finds nothing missing.
pub fn init_world(env: &LaunchEnv, libs: &LibSearch) -> Result<SharedComm, CommError> {
    let use_nccl = match env.backend {
        BackendChoice::Nccl => true,
        BackendChoice::Cpu => false,
        BackendChoice::Auto => {
            let why = nccl_unavailable(env, libs);
            if let Some(w) = &why {
                tracing::info!("backend auto: CPU world ({w})");
            }
            why.is_none()
        }
    };
    if use_nccl {
        Ok(Arc::new(init_world_nccl(env, libs)?))
    } else {
        let mut cpu_env = env.clone();
        cpu_env.backend = BackendChoice::Cpu;
        crate::tcp::init_world(&cpu_env)
    }
}
