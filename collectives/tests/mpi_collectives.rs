//! The MPI backend under `mpirun` (feature `mpi`): this test binary re-runs itself as the ranks
//! (`mpirun -np N <this binary> mpi_worker_entry`), which find their world from Open MPI's
//! variables alone. Random collective sequences on random sub-groups match the reference on the
//! MPI backend; bad arguments get the same typed errors as on the in-process backend; the CPU
//! world bootstraps its rendezvous through MPI; a world size the environment contradicts is
//! named. Skipped (with a note) when `mpirun` is not installed.
#![cfg(feature = "mpi")]

mod multiprocess_common;
mod process_world;

use std::process::Command;
use std::time::Duration;

use multiprocess_common::{dtype_of, run_rank, Case, DTYPES};
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::{
    init_world, Backend, BufMut, CommError, DType, InProcessWorld, ReduceOp, SharedComm,
};
use process_world::{run_worker, var};
use proptest::prelude::*;

/// The same bad calls on two communicators of the same size and rank: equal errors.
fn same_errors(mpi: &SharedComm, reference: &SharedComm) -> Result<(), String> {
    type Call = fn(&SharedComm) -> Result<(), CommError>;
    let calls: [(&str, Call); 5] = [
        ("odd bytes", |c| {
            let mut b = [0u8; 7];
            c.all_reduce(DType::F32, BufMut::Host(&mut b), ReduceOp::Sum)
        }),
        ("counts", |c| {
            let mut r = [0u8; 8];
            c.all_gather_v(
                DType::F64,
                (&[0u8; 8][..]).into(),
                (&mut r[..]).into(),
                &[1],
            )
        }),
        ("root", |c| {
            let mut b = [0u8; 8];
            c.broadcast(DType::I64, BufMut::Host(&mut b), c.size() + 3)
        }),
        ("own part", |c| {
            let n = c.size();
            let sc = vec![1usize; n];
            let mut rc = vec![1usize; n];
            rc[c.rank()] = 2;
            let mut r = vec![0u8; (n + 1) * 4];
            let s = vec![0u8; n * 4];
            c.all_to_all_v(DType::F32, (&s[..]).into(), &sc, (&mut r[..]).into(), &rc)
        }),
        ("sub-group", |c| {
            c.sub_group(&[c.rank(), c.rank()]).map(|_| ())
        }),
    ];
    for (what, call) in calls {
        let (a, b) = (call(mpi), call(reference));
        let (a, b) = match (a, b) {
            (Err(a), Err(b)) => (a.to_string(), b.to_string()),
            (a, b) => return Err(format!("{what}: mpi {a:?}, in-process {b:?}")),
        };
        if a != b {
            return Err(format!("{what}: mpi says {a:?}, in-process {b:?}"));
        }
    }
    Ok(())
}

fn worker() -> Result<(), String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let comm = init_world(&env);
    let mode = var("OXF_MPI_MODE");
    if mode == "mismatch" {
        return match comm {
            Err(CommError::Env(m)) if m.contains("MPI_COMM_WORLD has rank") => Ok(()),
            other => Err(format!(
                "expected a world-size error, got {:?}",
                other.err()
            )),
        };
    }
    let comm = comm.map_err(|e| format!("init_world: {e}"))?;
    let want = if mode == "bootstrap" {
        Backend::Cpu
    } else {
        Backend::Mpi
    };
    if comm.backend() != want {
        return Err(format!("backend {}, expected {want}", comm.backend()));
    }
    match mode.as_str() {
        "case" | "bootstrap" => {
            for seed in var("OXF_MPI_SEEDS").split(',') {
                let seed: u64 = seed.parse().map_err(|_| format!("seed {seed:?}"))?;
                let dtype = dtype_of((seed % DTYPES as u64) as usize);
                let case = Case::generate(seed, env.world_size, dtype, 10, 3000);
                run_rank(&comm, &case).map_err(|e| format!("seed {seed}: {e}"))?;
            }
            Ok(())
        }
        "bad-args" => {
            let mut reference = InProcessWorld::new(env.world_size, Duration::from_secs(5));
            same_errors(&comm, &reference.swap_remove(env.rank))
        }
        m => Err(format!("unknown mode {m:?}")),
    }
}

#[test]
fn mpi_worker_entry() {
    run_worker("OXF_MPI_ROLE", worker);
}

/// `mpirun -np n` of this binary's worker in `mode` on `backend` with `vars` set (and no
/// oflaunch variables), asserting that every rank passed; skipped (with a note) when mpirun is
/// not installed.
fn mpirun(n: usize, backend: &str, mode: &str, vars: &[(&str, String)]) {
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("mpi_collectives: skipped: mpirun is not installed");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(n.to_string())
        .arg(exe)
        .args([
            "mpi_worker_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("OXF_MPI_ROLE", "worker")
        .env("OXIFLOW_TIMEOUT", "60")
        .env("OXIFLOW_BACKEND", backend)
        .env("OXF_MPI_MODE", mode);
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
    ] {
        c.env_remove(k);
    }
    for k in ["MASTER_PORT", "OXIFLOW_TOKEN"] {
        c.env_remove(k);
    }
    for (k, v) in vars {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{mode} on {backend}, {n} ranks, {vars:?}: mpirun failed ({:?}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]
    #[test]
    fn random_collectives_match_the_reference_on_mpi(seed in any::<u64>(), world in 1usize..=4) {
        let seeds: Vec<String> = (0..4).map(|k| seed.wrapping_add(k).to_string()).collect();
        mpirun(world, "mpi", "case", &[("OXF_MPI_SEEDS", seeds.join(","))]);
    }
}

#[test]
fn bad_arguments_get_the_in_process_errors_on_mpi() {
    mpirun(3, "mpi", "bad-args", &[]);
}

#[test]
fn the_cpu_world_bootstraps_its_rendezvous_through_mpi() {
    mpirun(3, "cpu", "bootstrap", &[("OXF_MPI_SEEDS", "11,12".into())]);
}

#[test]
fn a_world_size_the_environment_contradicts_is_named() {
    // WORLD_SIZE/RANK set by hand for 3 ranks while mpirun starts 2.
    let vars = [("RANK", "0".into()), ("WORLD_SIZE", "3".into())];
    mpirun(2, "mpi", "mismatch", &vars);
}
