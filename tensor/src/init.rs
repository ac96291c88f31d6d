//! Process start-up: the default runtime context from the launch environment
//! (`LaunchEnv` -> TCP world, or NCCL when `OXIFLOW_BACKEND=nccl`), or from a communicator the
//! caller already has.

use oxiflow_collectives::cuda_libs::LibSearch;
use oxiflow_collectives::env::{BackendChoice, LaunchEnv};
use oxiflow_collectives::SharedComm;

use crate::context::Context;
use crate::{Result, TensorError};

/// Makes a context over `world` the process default and returns it.
pub fn init_with_world(world: SharedComm) -> Context {
    let ctx = Context::new(world);
    ctx.set_default();
    ctx
}

/// Reads the launch environment (torchrun/oflaunch names, see `collectives::env`), joins the
/// world through the rendezvous store, and installs the process-wide default context. The CPU
/// (TCP) world serves `auto` and `cpu`; `nccl` builds the NCCL world (for CUDA placements).
pub fn init_from_env() -> Result<Context> {
    let op = "init_from_env";
    let env = LaunchEnv::from_env().map_err(|source| TensorError::Comm { op, source })?;
    let world = match env.backend {
        BackendChoice::Nccl => oxiflow_collectives::nccl::init_world(&env, &LibSearch::default()),
        BackendChoice::Auto | BackendChoice::Cpu => oxiflow_collectives::init_world(&env),
    }
    .map_err(|source| TensorError::Comm { op, source })?;
    Ok(init_with_world(world))
}
