//! Process start-up: the default runtime context from the launch environment
//! (`LaunchEnv` -> TCP world, or NCCL with the CUDA backend bound to the same device), or from a
//! communicator the caller already has.
//!
//! Backend choice (`OXIFLOW_BACKEND`, set by `oflaunch --backend`): `nccl` builds the NCCL world
//! on the device of the local rank and binds the CUDA backend to that device and to the stream
//! NCCL orders against; `cpu` the CPU (TCP) world; `auto` picks NCCL when the CUDA driver, NCCL
//! and one GPU per local rank are present (multi-rank jobs), else the CPU world. An NCCL world
//! moves device pieces only: programs on cpu placements should ask for `--backend cpu`.

use std::sync::Arc;

use oxiflow_collectives::cuda_libs::LibSearch;
use oxiflow_collectives::env::{BackendChoice, LaunchEnv};
use oxiflow_collectives::nccl::{init_world_nccl, nccl_unavailable, Completion};
use oxiflow_collectives::SharedComm;

use crate::context::Context;
use crate::op_trace;
use crate::{Result, TensorError};

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
    let use_nccl = match env.backend {
        BackendChoice::Nccl => true,
        BackendChoice::Cpu => false,
        BackendChoice::Auto => env.world_size > 1 && nccl_unavailable(env, &libs).is_none(),
    };
    if use_nccl {
        let comm =
            init_world_nccl(env, &libs).map_err(|source| TensorError::Comm { op, source })?;
        let rt = crate::cuda::init_cuda_on(comm.context().clone())?;
        // Device blocks from the driver's allocator, unless `OXIFLOW_NCCL_MEMORY=1` asks for
        // NCCL's (registered: large collectives move them zero-copy, but a training step that
        // reduces gradients in such blocks measured several times slower on 2 GPUs).
        rt.set_nccl_memory(env.nccl_memory);
        // Kernels and collectives share one order: NCCL waits for the compute stream and the
        // compute stream for NCCL, with no host synchronisation.
        comm.set_compute_stream(rt.stream().clone());
        comm.set_completion(Completion::Async);
        return Ok(init_with_world(Arc::new(comm)));
    }
    let mut cpu = env.clone();
    cpu.backend = BackendChoice::Cpu;
    let world =
        oxiflow_collectives::init_world(&cpu).map_err(|source| TensorError::Comm { op, source })?;
    Ok(init_with_world(world))
}
