//! `train` started without oflaunch: under `mpirun -np 4` (the CPU world, its rendezvous
//! bootstrapped through MPI, and `--backend mpi`) and under a simulated Slurm step (4 processes
//! with the variables `srun` sets), each giving the loss curve of `oflaunch --nproc-per-node 4`.
//! Bad setups fail with clear messages: mpirun with a build lacking the `mpi` feature, a
//! multi-node Slurm step without MASTER_ADDR. The mpirun parts print a note and pass when
//! `mpirun` is not installed.

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use common::{argv, cargo, curve, max_rel, release_dir};

const MPI: bool = cfg!(feature = "mpi");
const ARGS: [&str; 8] = [
    "--model",
    "mlp",
    "--steps",
    "20",
    "--log-every",
    "1",
    "--seed",
    "4",
];

/// (oflaunch, a private copy of train built with this test's features).
fn binaries() -> &'static (PathBuf, PathBuf) {
    static BINS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BINS.get_or_init(|| {
        let mut train_build = vec!["build", "--release", "--example", "train"];
        if MPI {
            train_build.extend(["--features", "mpi"]);
        }
        cargo(&train_build);
        cargo(&argv("build --release -p oxiflow-launcher --bin oflaunch"));
        let rel = release_dir();
        // A copy: other tests may rebuild train with other features meanwhile.
        let train = rel.join(format!("train-mpi-test-{}", std::process::id()));
        std::fs::copy(rel.join("examples").join("train"), &train).expect("copy train");
        (rel.join("oflaunch"), train)
    })
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn oflaunch_curve() -> Vec<(u64, f64)> {
    let (oflaunch, train) = binaries();
    let out = Command::new(oflaunch)
        .args(["--nproc-per-node", "4", "--backend", "cpu"])
        .arg(train)
        .args(ARGS)
        .output()
        .unwrap();
    assert!(out.status.success(), "oflaunch: {}", text(&out));
    let c = curve(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(c.len(), 20, "{}", text(&out));
    c
}

fn have_mpirun() -> bool {
    let found = Command::new("mpirun").arg("--version").output().is_ok();
    if !found {
        eprintln!("mpi_train: skipped: mpirun is not installed");
    }
    found
}

/// `mpirun -np 4 train ARGS extra`, through `| cat` so train's stdout is not mpirun's terminal
/// (train draws a progress bar instead of loss lines on a terminal); train's exit status is
/// kept (pipefail).
fn mpirun_train(extra: &[&str]) -> Output {
    let (_, train) = binaries();
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", "4"])
        .args(["bash", "-c", "set -o pipefail; \"$0\" \"$@\" | cat"])
        .arg(train)
        .args(ARGS)
        .args(extra);
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OXIFLOW_TOKEN",
        "OXIFLOW_BACKEND",
    ] {
        c.env_remove(k);
    }
    c.output().unwrap()
}

#[test]
fn train_under_mpirun_matches_oflaunch() {
    if !have_mpirun() {
        return;
    }
    let cpu = mpirun_train(&[]);
    let mpi = mpirun_train(&["--backend", "mpi"]);
    if !MPI {
        // Without the feature: a clear error, not a hang or a stray single-rank run.
        assert!(!cpu.status.success(), "{}", text(&cpu));
        assert!(
            text(&cpu).contains("without MASTER_PORT, OXIFLOW_TOKEN")
                && text(&cpu).contains("--features mpi"),
            "{}",
            text(&cpu)
        );
        assert!(!mpi.status.success());
        assert!(text(&mpi).contains("no MPI support"), "{}", text(&mpi));
        return;
    }
    let reference = oflaunch_curve();
    assert!(cpu.status.success(), "mpirun (cpu): {}", text(&cpu));
    let cpu_curve = curve(&String::from_utf8_lossy(&cpu.stdout));
    // The same CPU backend with the same reduction order: bitwise the same losses.
    assert_eq!(cpu_curve, reference, "mpirun (cpu) vs oflaunch");
    assert!(mpi.status.success(), "mpirun --backend mpi: {}", text(&mpi));
    let mpi_curve = curve(&String::from_utf8_lossy(&mpi.stdout));
    let diff = max_rel(&reference, &mpi_curve);
    eprintln!(
        "mpirun --backend mpi: loss {:.8} -> {:.8}, max relative difference to oflaunch {diff:.2e}",
        mpi_curve[0].1, mpi_curve[19].1
    );
    // MPI sums in its own order: equal up to float rounding.
    assert!(diff < 1e-6, "--backend mpi differs by {diff:e}");
}

/// The variables `srun --ntasks 4` sets on one node (plus what every CPU world needs).
fn slurm_vars(rank: usize, port: u16, token: &str) -> Vec<(&'static str, String)> {
    vec![
        ("SLURM_PROCID", rank.to_string()),
        ("SLURM_NTASKS", "4".into()),
        ("SLURM_LOCALID", rank.to_string()),
        ("SLURM_NODEID", "0".into()),
        ("SLURM_NNODES", "1".into()),
        ("SLURM_STEP_TASKS_PER_NODE", "4".into()),
        ("SLURM_TASKS_PER_NODE", "4".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("OXIFLOW_TOKEN", token.into()),
        ("OXIFLOW_BACKEND", "cpu".into()),
    ]
}

fn clean(c: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars() {
        if k.starts_with("SLURM_")
            || k.starts_with("OMPI_")
            || k.starts_with("PMI")
            || ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"].contains(&k.as_str())
        {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn train_under_a_simulated_slurm_step_matches_oflaunch() {
    let reference = oflaunch_curve();
    let (_, train) = binaries();
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let token = oxiflow::collectives::rendezvous::generate_token().unwrap();
    let children: Vec<_> = (0..4)
        .map(|r| {
            let mut c = Command::new(train);
            clean(&mut c)
                .args(ARGS)
                .envs(slurm_vars(r, port, &token))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "slurm rank {r}: {}", text(o));
    }
    let c = curve(&String::from_utf8_lossy(&outs[0].stdout));
    assert_eq!(c, reference, "simulated srun vs oflaunch");
}

#[test]
fn a_multi_node_slurm_step_without_master_addr_is_refused() {
    let (_, train) = binaries();
    let mut c = Command::new(train);
    let mut vars = slurm_vars(0, 29500, "x");
    vars.retain(|(k, _)| !["MASTER_ADDR", "OXIFLOW_TOKEN"].contains(k));
    vars.extend([
        ("SLURM_NNODES", "2".into()),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x2)".into()),
        ("SLURM_TASKS_PER_NODE", "2(x2)".into()),
    ]);
    let out = clean(&mut c)
        .env_remove("MASTER_ADDR")
        .args(ARGS)
        .envs(vars)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("MASTER_ADDR is missing: the 4 ranks span several nodes"),
        "{}",
        text(&out)
    );
}
