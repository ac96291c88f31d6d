//! OneFlow's "Global Tensor basic operations", in OxiFlow: two ranks create a global tensor
//! with randn and S(0), look at the local pieces, turn S(0) into B, and multiply an S(0) tensor
//! by a B one, which gives S(0).
//!
//! Run: `oflaunch --nproc-per-node 2 global_tensor_basics`, or by hand in two shells with
//! `MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=<0|1> LOCAL_RANK=<0|1>
//! OXIFLOW_TOKEN=<any shared secret> cargo run --example global_tensor_basics`.

use oxiflow::prelude::*;

/// Failures print as one line: `oxiflow::Error`'s Debug form is its message.
fn main() -> Result<(), oxiflow::Error> {
    let ctx = oxiflow::init_from_env()?;
    if ctx.world_size() != 2 {
        return Err(oxiflow::Error::Program(format!(
            "global_tensor_basics needs 2 ranks but was started as {} (run it with \
             `oflaunch --nproc-per-node 2 global_tensor_basics`)",
            ctx.world_size()
        )));
    }
    let rank = ctx.rank();
    let placement = Placement::new_1d(DeviceType::Cpu, vec![0, 1])?;

    // 1. A global tensor from a creation op: each rank generates only its own rows.
    let x = Tensor::randn_global([4, 5], 42, DType::F32, &placement, Sbp::S(0))?;
    println!(
        "rank {rank}: x is global: {}, shape {}, sbp {}, placement {}",
        x.is_global(),
        x.shape(),
        x.nd_sbp().map(|s| s.to_string()).unwrap_or_default(),
        x.placement().map(|p| p.to_string()).unwrap_or_default()
    );

    // 2. The local piece of this rank: rows 2*rank..2*rank+2.
    let local = x.to_local();
    println!(
        "rank {rank}: x.to_local() has shape {}:\n{}",
        local.shape(),
        local
    );

    // 3. A global tensor from local tensors: each rank's [2, 5] becomes a piece of [4, 5].
    let mine = Tensor::randn([2, 5], rank as u64, DType::F32);
    let y = mine.to_global(&placement, Sbp::S(0))?;
    println!(
        "rank {rank}: local [2, 5] -> global {} as {}",
        y.shape(),
        y.nd_sbp().map(|s| s.to_string()).unwrap_or_default()
    );

    // 4. S(0) -> B: an all-gather; every rank now holds the whole [4, 5].
    let xb = x.to_global(&placement, Sbp::B)?;
    println!(
        "rank {rank}: after S(0) -> B the local piece has shape {}",
        xb.to_local().shape()
    );

    // 5. matmul of S(0) by B gives S(0): each rank multiplies its rows, no communication.
    let w = Tensor::randn_global([5, 3], 7, DType::F32, &placement, Sbp::B)?;
    let z = x.matmul(&w)?;
    println!(
        "rank {rank}: x (S(0)) @ w (B) -> z shape {} sbp {}, local piece {}",
        z.shape(),
        z.nd_sbp().map(|s| s.to_string()).unwrap_or_default(),
        z.to_local().shape()
    );

    // The whole value, gathered on every rank, equals the single-device computation.
    let whole = z.to_ndarray::<f32>()?;
    let single =
        Tensor::randn([4, 5], 42, DType::F32).matmul(&Tensor::randn([5, 3], 7, DType::F32))?;
    let err = whole
        .iter()
        .zip(single.to_ndarray::<f32>()?.iter())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!("rank {rank}: z gathered:\n{whole}\nmax |z - single-device z| = {err:e}");
    // On a GPU the device's start-up builds may still run: the process must not exit under
    // them.
    oxiflow::finish_background_builds(std::time::Duration::from_secs(120));
    Ok(())
}
