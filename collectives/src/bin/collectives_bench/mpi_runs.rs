//! The MPI columns of collectives_bench (feature `mpi`): OxiFlow's MPI backend and bare Open MPI
//! through rsmpi alone (`MPI_Allreduce`, `MPI_Allgather`, `MPI_Reduce_scatter_block`,
//! `MPI_Alltoall` on f32 buffers, out of place), both started by `mpirun` and timed like the
//! CPU backend (median of repeats, a barrier before each).

use std::process::Command;
use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::traits::*;

use super::{parse, repeats, Results, OPS};

/// `mpirun -n n <this binary> <mode> --sizes sizes`, rank 0's RESULT lines.
pub fn run_under_mpirun(n: usize, mode: &str, sizes: &str) -> Result<Results, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        &n.to_string(),
    ])
    .arg(exe)
    .args([mode, "--sizes", sizes])
    .env("OXIFLOW_BACKEND", "mpi")
    .env("OXIFLOW_TIMEOUT", "600");
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
        c.env_remove(k);
    }
    let o = c.output().map_err(|e| format!("mpirun: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "mpirun {mode} failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    Ok(parse(&String::from_utf8_lossy(&o.stdout)))
}

/// One rank of the bare-MPI run: rsmpi calls only, no OxiFlow.
pub fn bare_worker(sizes: &[usize]) -> Result<(), String> {
    let universe = mpi::initialize().ok_or("MPI is already initialised")?;
    let world = universe.world();
    let n = world.size() as usize;
    for op in OPS {
        for &size in sizes {
            let e = size / 4;
            let per = e / n;
            let a = vec![1f32; if op == "all_reduce" { e } else { per * n }];
            let mut b = vec![0f32; if op == "all_reduce" { e } else { per * n }];
            let run = |b: &mut Vec<f32>| match op {
                "all_reduce" => world.all_reduce_into(&a[..], &mut b[..], SystemOperation::sum()),
                "all_gather" => world.all_gather_into(&a[..per], &mut b[..]),
                "reduce_scatter" => {
                    world.reduce_scatter_block_into(&a[..], &mut b[..per], SystemOperation::sum())
                }
                _ => world.all_to_all_into(&a[..], &mut b[..]),
            };
            run(&mut b);
            let mut times = Vec::new();
            for _ in 0..repeats(size) {
                world.barrier();
                let t = Instant::now();
                run(&mut b);
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            if world.rank() == 0 {
                println!("RESULT {op} {size} {}", times[times.len() / 2]);
            }
        }
    }
    Ok(())
}
