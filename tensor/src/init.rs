//! Process start-up: the default runtime context from the launch environment
//! (`LaunchEnv` -> world communicator), or from a communicator the caller already has.

use oxiflow_collectives::env::LaunchEnv;
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
/// world through the rendezvous store, and installs the process-wide default context.
pub fn init_from_env() -> Result<Context> {
    let env = LaunchEnv::from_env().map_err(|source| TensorError::Comm {
        op: "init_from_env",
        source,
    })?;
    let world = if env.world_size == 1 {
        oxiflow_collectives::InProcessWorld::new(1, env.timeout)
            .into_iter()
            .next()
    } else {
        None
    };
    match world {
        Some(w) => Ok(init_with_world(w)),
        None => Err(TensorError::World {
            op: "init_from_env",
            placement: "-".into(),
            world_size: env.world_size,
            detail: "the multi-process (TCP) world is not available in this build".into(),
        }),
    }
}
