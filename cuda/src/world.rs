//! Process start-up with the CUDA backend: [`init_from_env`] and [`init_with_env`] register
//! this crate's NCCL-world join with the tensor core, then start the process as the core does
//! (`oxiflow_tensor::init_with_env`: the NCCL world on the local rank's GPU, or the CPU world).

use std::sync::Arc;

use oxiflow_collectives::cuda_libs::LibSearch;
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::nccl::{init_world_nccl, Completion};
use oxiflow_collectives::SharedComm;
use oxiflow_tensor::{Context, Result, TensorError};

use crate::init_cuda_on;

/// Builds the NCCL world `env` describes and binds the CUDA backend to its device and to the
/// stream NCCL orders against (the tensor core's `NcclWorldJoin`).
fn join_nccl_world(env: &LaunchEnv, libs: &LibSearch) -> Result<SharedComm> {
    let comm = init_world_nccl(env, libs).map_err(|source| TensorError::Comm {
        op: "init_from_env",
        source,
    })?;
    let rt = init_cuda_on(comm.context().clone())?;
    // Device blocks from the driver's allocator, unless `OXIFLOW_NCCL_MEMORY=1` asks for
    // NCCL's (registered: large collectives move them zero-copy, but a training step that
    // reduces gradients in such blocks measured several times slower on 2 GPUs).
    rt.set_nccl_memory(env.nccl_memory);
    // Kernels and collectives share one order: NCCL waits for the compute stream and the
    // compute stream for NCCL, with no host synchronisation.
    comm.set_compute_stream(rt.stream().clone());
    comm.set_completion(Completion::Async);
    Ok(Arc::new(comm))
}

/// Reads the launch environment (torchrun/oflaunch names, see `collectives::env`), joins the
/// world (NCCL with each rank bound to its GPU, or the CPU backend) and installs the
/// process-wide default context.
pub fn init_from_env() -> Result<Context> {
    oxiflow_tensor::register_nccl_world(join_nccl_world);
    oxiflow_tensor::init_from_env()
}

/// [`init_from_env`] for a launch environment a program builds itself (a test's own
/// rendezvous store, say).
pub fn init_with_env(env: &LaunchEnv) -> Result<Context> {
    oxiflow_tensor::register_nccl_world(join_nccl_world);
    oxiflow_tensor::init_with_env(env)
}
