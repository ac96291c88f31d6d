//! Shared helpers of the ops tests: placements and nd-SBPs drawn from seeds.

#![allow(dead_code)]

use oxiflow_collectives::env::{BackendChoice, LaunchEnv};
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};
use oxiflow_cuda::init_with_env;
use oxiflow_placement::Placement;
use oxiflow_tensor::{Context, DeviceType, NdSbp, Sbp};

/// This process as rank 0 of a one-rank NCCL world bound to cuda:0, through a rendezvous store
/// of its own (kept alive by the returned server), installed as the default context: how a
/// rank runs under `oflaunch --backend nccl`, so device pieces box as on a GPU job.
pub fn cuda_world() -> Result<(Context, StoreServer), String> {
    let token = generate_token().map_err(|e| e.to_string())?;
    let server = StoreServer::bind("127.0.0.1:0".parse().expect("an address"), token.clone())
        .map_err(|e| e.to_string())?;
    let addr = server.local_addr();
    let mut env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    env.rank = 0;
    env.world_size = 1;
    env.local_rank = 0;
    env.local_world_size = 1;
    env.master_addr = addr.ip().to_string();
    env.master_port = addr.port();
    env.token = Some(token);
    env.backend = BackendChoice::Nccl;
    let ctx = init_with_env(&env).map_err(|e| e.to_string())?;
    Ok((ctx, server))
}

/// A placement over mesh `mesh` with its ranks permuted by `perm`.
pub fn placement(mesh: &[usize], perm: u64) -> Placement {
    let n: usize = mesh.iter().product();
    let mut ranks: Vec<usize> = (0..n).collect();
    let mut s = perm;
    for i in (1..n).rev() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ranks.swap(i, (s >> 33) as usize % (i + 1));
    }
    Placement::new(DeviceType::Cpu, mesh.to_vec(), ranks).unwrap()
}

/// One SBP per mesh axis from `seed`: S(0..ndim), B, or (with `allow_p`) P.
pub fn nd_sbp(naxes: usize, ndim: usize, seed: u64, allow_p: bool) -> NdSbp {
    let mut s = seed;
    NdSbp::new((0..naxes).map(|_| {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        match (s >> 33) as usize % (ndim + 1 + usize::from(allow_p)) {
            d if d < ndim => Sbp::S(d),
            d if d == ndim => Sbp::B,
            _ => Sbp::P,
        }
    }))
}
