//! The launch contract of a job whose ranks all run on this host, as the variables a parent
//! sets on each child (what oflaunch sets for one node, read back by `LaunchEnv::from_env`).

use std::net::SocketAddr;

/// torchrun's rank variables for rank `rank` of a `world`-rank job on one host, the store's
/// address `store` (`MASTER_ADDR`, `MASTER_PORT`) and `OXIFLOW_TOKEN`: pass them to
/// `Command::envs`.
pub fn one_host_launch_vars(
    rank: usize,
    world: usize,
    store: SocketAddr,
    token: &str,
) -> [(&'static str, String); 7] {
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", store.ip().to_string()),
        ("MASTER_PORT", store.port().to_string()),
        ("OXIFLOW_TOKEN", token.to_string()),
    ]
}
