//! Process start-up: the default runtime context from the launch environment
//! (`LaunchEnv` -> TCP world, or NCCL with the CUDA backend bound to the same device), or from a
//! communicator the caller already has.
//!
//! Backend choice (`OXIFLOW_BACKEND`, set by `oflaunch --backend`): `nccl` joins the NCCL world
//! through the registered [`NcclWorldJoin`] (the CUDA crate's, which binds its backend to the
//! device of the local rank and to the stream NCCL orders against); `cpu` the CPU (TCP) world;
//! `auto` picks NCCL when a join is registered and the CUDA driver, NCCL and one GPU per local
//! rank are present (multi-rank jobs), else the CPU world. An NCCL world moves device pieces
//! only: programs on cpu placements should ask for `--backend cpu`.

use std::sync::RwLock;

use oxiflow_collectives::cuda_libs::LibSearch;
use oxiflow_collectives::env::{BackendChoice, LaunchEnv};
use oxiflow_collectives::nccl::nccl_unavailable;
use oxiflow_collectives::SharedComm;

use crate::context::Context;
use crate::op_trace;
use crate::{Result, TensorError};

/// How a device backend crate joins an NCCL world: builds the communicator `env` describes on
/// the device of the local rank and binds its backend to that device.
pub type NcclWorldJoin = fn(&LaunchEnv, &LibSearch) -> Result<SharedComm>;

static NCCL_JOIN: RwLock<Option<NcclWorldJoin>> = RwLock::new(None);

/// Registers how `init_with_env` joins an NCCL world (the CUDA crate's init does, before it
/// calls `init_with_env`).
pub fn register_nccl_world(join: NcclWorldJoin) {
    *NCCL_JOIN.write().unwrap_or_else(|p| p.into_inner()) = Some(join);
}

/// Makes a context over `world` the process default and returns it.
pub fn init_with_world(world: SharedComm) -> Context {
    op_trace::install();
    let ctx = Context::new(world);
    ctx.set_default();
    ctx
}

/// Reads the launch environment (torchrun/oflaunch names, see `collectives::env`), joins the
/// world through the rendezvous store, and installs the process-wide default context.
pub fn init_from_env() -> Result<Context> {
    let env = LaunchEnv::from_env().map_err(|source| TensorError::Comm {
        op: "init_from_env",
        source,
    })?;
    init_with_env(&env)
}

/// Joins the world `env` describes (NCCL with each rank bound to its GPU, or the CPU backend)
/// and installs the process-wide default context: `init_from_env` for a launch environment a
/// program builds itself (a test's own rendezvous store, say).
pub fn init_with_env(env: &LaunchEnv) -> Result<Context> {
    let op = "init_from_env";
    let libs = LibSearch::default();
    let join = *NCCL_JOIN.read().unwrap_or_else(|p| p.into_inner());
    let use_nccl = match env.backend {
        BackendChoice::Nccl => true,
        BackendChoice::Cpu => false,
        BackendChoice::Auto => {
            join.is_some() && env.world_size > 1 && nccl_unavailable(env, &libs).is_none()
        }
    };
    if use_nccl {
        let join = join.ok_or_else(|| TensorError::Device {
            op,
            devices: "cuda".into(),
            shapes: String::new(),
            detail: "the nccl backend needs the CUDA backend registered: start the process \
                     with oxiflow_cuda::init_from_env (oxiflow::init_from_env)"
                .into(),
        })?;
        return Ok(init_with_world(join(env, &libs)?));
    }
    let mut cpu = env.clone();
    cpu.backend = BackendChoice::Cpu;
    let world =
        oxiflow_collectives::init_world(&cpu).map_err(|source| TensorError::Comm { op, source })?;
    Ok(init_with_world(world))
}
