//! collectives_bench: bus bandwidth (nccl-tests definitions) of the CPU backend's all-reduce,
//! all-gather, reduce-scatter and all-to-all for 2 and 4 local ranks, next to Open MPI (mpi4py)
//! and, when torch is importable, gloo, run on the same host in the same run. Built with the
//! `mpi` feature it adds OxiFlow's MPI backend (`mpi-backend`) and bare Open MPI through rsmpi
//! (`bare-mpi`), both under mpirun.
//!
//! Usage: collectives_bench [--ranks 2,4] [--min 4096] [--max 268435456]
//! [--anchors mpi,gloo,mpi-backend,bare-mpi] (the binary re-runs itself as
//! `collectives_bench worker|bare-mpi ...` for the ranks).

#[cfg(feature = "mpi")]
mod mpi_runs;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use oxiflow_collectives::env::{one_host_launch_vars, LaunchEnv};
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};
use oxiflow_collectives::{init_world, DType, ReduceOp, SharedComm};

const OPS: [&str; 4] = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"];
type Results = HashMap<(String, usize), f64>;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn repeats(size: usize) -> usize {
    ((64usize << 20) / size.max(1)).clamp(3, 20)
}

fn time_op(comm: &SharedComm, op: &str, size: usize) -> Result<f64, String> {
    let n = comm.size();
    let e = size / 4;
    let per = e / n;
    let f = DType::F32;
    let mut a = vec![
        1u8;
        if op == "all_reduce" {
            e * 4
        } else {
            per * n * 4
        }
    ];
    let mut b = vec![0u8; per * n * 4];
    let run = |a: &mut Vec<u8>, b: &mut Vec<u8>| -> Result<(), String> {
        match op {
            "all_reduce" => comm.all_reduce(f, (&mut a[..]).into(), ReduceOp::Sum),
            "all_gather" => comm.all_gather(f, (&a[..per * 4]).into(), (&mut b[..]).into()),
            "reduce_scatter" => comm.reduce_scatter(
                f,
                (&a[..]).into(),
                (&mut b[..per * 4]).into(),
                ReduceOp::Sum,
            ),
            _ => comm.all_to_all_v(
                f,
                (&a[..]).into(),
                &vec![per; n],
                (&mut b[..]).into(),
                &vec![per; n],
            ),
        }
        .map_err(|e| e.to_string())
    };
    run(&mut a, &mut b)?;
    let mut times = Vec::new();
    for _ in 0..repeats(size) {
        comm.barrier().map_err(|e| e.to_string())?;
        let t = Instant::now();
        run(&mut a, &mut b)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn worker(args: &[String]) -> Result<(), String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let comm = init_world(&env).map_err(|e| e.to_string())?;
    let sizes: Vec<usize> = arg(args, "--sizes", "")
        .split(',')
        .filter_map(|s| s.parse().ok())
        .collect();
    for op in OPS {
        for &s in &sizes {
            let t = time_op(&comm, op, s)?;
            if env.rank == 0 {
                println!("RESULT {op} {s} {t}");
            }
        }
    }
    Ok(())
}

fn parse(out: &str) -> Results {
    out.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() == 4 && w[0] == "RESULT")
                .then(|| Some(((w[1].to_string(), w[2].parse().ok()?), w[3].parse().ok()?)))?
        })
        .collect()
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// Starts `n` processes of `cmd` with the launch contract set; returns rank 0's stdout.
fn spawn_ranks(n: usize, cmd: &[String], port: u16, token: &str) -> Result<String, String> {
    let store = SocketAddr::from(([127, 0, 0, 1], port));
    let children: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&cmd[0])
                .args(&cmd[1..])
                .envs(one_host_launch_vars(r, n, store, token))
                .env("OXIFLOW_TIMEOUT", "600")
                .env("OXIFLOW_BACKEND", "cpu")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start {}: {e}", cmd[0]))
        })
        .collect::<Result<_, _>>()?;
    let mut out0 = String::new();
    for (r, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output().map_err(|e| e.to_string())?;
        if !o.status.success() {
            return Err(format!(
                "rank {r} failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        if r == 0 {
            out0 = String::from_utf8_lossy(&o.stdout).into_owned();
        }
    }
    Ok(out0)
}

fn python_with(module: &str) -> Result<String, String> {
    for py in ["python3", "/usr/bin/python3", "python"] {
        let ok = Command::new(py)
            .args(["-c", &format!("import {module}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            return Ok(py.to_string());
        }
    }
    Err(format!("no python3 with {module} importable"))
}

fn anchor_script() -> Result<PathBuf, String> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench/mpi_anchor.py");
    if p.exists() {
        return Ok(p);
    }
    // Run from a copy of the repository elsewhere (e.g. the GPU machines): its root or here.
    ["collectives/bench/mpi_anchor.py", "mpi_anchor.py"]
        .into_iter()
        .map(PathBuf::from)
        .find(|c| c.exists())
        .ok_or_else(|| format!("{} not found", p.display()))
}

fn run_mpi(n: usize, sizes: &str) -> Result<Results, String> {
    Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("mpirun not found: {e}"))?;
    let py = python_with("mpi4py, numpy")?;
    let script = anchor_script()?;
    let o = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            &n.to_string(),
            &py,
        ])
        .arg(&script)
        .args(["--sizes", sizes])
        .output()
        .map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(format!(
            "mpirun failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    Ok(parse(&String::from_utf8_lossy(&o.stdout)))
}

fn run_gloo(n: usize, sizes: &str) -> Result<Results, String> {
    let py = python_with("torch")?;
    let script = anchor_script()?;
    let cmd = vec![
        py,
        script.display().to_string(),
        "--gloo".into(),
        "--sizes".into(),
        sizes.into(),
    ];
    spawn_ranks(n, &cmd, free_port()?, "unused").map(|o| parse(&o))
}

#[cfg(feature = "mpi")]
fn run_mpi_backend(n: usize, sizes: &str) -> Result<Results, String> {
    mpi_runs::run_under_mpirun(n, "worker", sizes)
}

#[cfg(feature = "mpi")]
fn run_bare_mpi(n: usize, sizes: &str) -> Result<Results, String> {
    mpi_runs::run_under_mpirun(n, "bare-mpi", sizes)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi_backend(_: usize, _: &str) -> Result<Results, String> {
    Err("built without the mpi feature".into())
}

#[cfg(not(feature = "mpi"))]
fn run_bare_mpi(_: usize, _: &str) -> Result<Results, String> {
    Err("built without the mpi feature".into())
}

fn busbw(op: &str, size: usize, n: usize, t: f64) -> f64 {
    let nf = n as f64;
    let factor = if op == "all_reduce" {
        2.0 * (nf - 1.0) / nf
    } else {
        (nf - 1.0) / nf
    };
    size as f64 / t * factor / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        if let Err(e) = worker(&args) {
            eprintln!("collectives_bench worker: {e}");
            std::process::exit(1);
        }
        return;
    }
    #[cfg(feature = "mpi")]
    if args.get(1).map(String::as_str) == Some("bare-mpi") {
        let sizes: Vec<usize> = arg(&args, "--sizes", "")
            .split(',')
            .filter_map(|s| s.parse().ok())
            .collect();
        if let Err(e) = mpi_runs::bare_worker(&sizes) {
            eprintln!("collectives_bench bare-mpi: {e}");
            std::process::exit(1);
        }
        return;
    }
    let ranks: Vec<usize> = arg(&args, "--ranks", "2,4")
        .split(',')
        .filter_map(|s| s.parse().ok())
        .collect();
    let min: usize = arg(&args, "--min", "4096").parse().unwrap_or(4096);
    let max: usize = arg(&args, "--max", "268435456")
        .parse()
        .unwrap_or(256 << 20);
    let default_anchors = if cfg!(feature = "mpi") {
        "mpi,gloo,mpi-backend,bare-mpi"
    } else {
        "mpi,gloo"
    };
    let anchors = arg(&args, "--anchors", default_anchors);
    let mut sizes = Vec::new();
    let mut s = min;
    while s <= max {
        sizes.push(s);
        s *= 4;
    }
    let size_list = sizes
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let exe = match std::env::current_exe() {
        Ok(e) => e.display().to_string(),
        Err(e) => {
            eprintln!("collectives_bench: current_exe: {e}");
            std::process::exit(1);
        }
    };
    for &n in &ranks {
        let ours = (|| -> Result<Results, String> {
            let token = generate_token().map_err(|e| e.to_string())?;
            let server = StoreServer::bind(
                "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?,
                token.clone(),
            )
            .map_err(|e| e.to_string())?;
            let cmd = vec![
                exe.clone(),
                "worker".into(),
                "--sizes".into(),
                size_list.clone(),
            ];
            let out = spawn_ranks(n, &cmd, server.local_addr().port(), &token);
            drop(server);
            out.map(|o| parse(&o))
        })();
        let ours = match ours {
            Ok(r) => r,
            Err(e) => {
                eprintln!("collectives_bench: {n} ranks failed: {e}");
                std::process::exit(1);
            }
        };
        let mut anchor_cols: Vec<(&str, Results)> = Vec::new();
        for (name, f) in [
            ("mpi", run_mpi as fn(usize, &str) -> Result<Results, String>),
            ("gloo", run_gloo),
            ("mpi-backend", run_mpi_backend),
            ("bare-mpi", run_bare_mpi),
        ] {
            if !anchors.split(',').any(|a| a == name) {
                continue;
            }
            match f(n, &size_list) {
                Ok(r) => anchor_cols.push((name, r)),
                Err(e) => println!("{name} anchor unavailable: {e}"),
            }
        }
        println!("\n{n} ranks, f32, busbw in GB/s (nccl-tests definitions), median of repeats");
        let mut header = format!("{:<15} {:>10} {:>10}", "op", "bytes", "oxiflow");
        for (name, _) in &anchor_cols {
            header += &format!(" {:>10} {:>8}", name, "ratio");
        }
        println!("{header}");
        for op in OPS {
            for &s in &sizes {
                let Some(&t) = ours.get(&(op.to_string(), s)) else {
                    continue;
                };
                let mine = busbw(op, s, n, t);
                let mut line = format!("{op:<15} {s:>10} {mine:>10.3}");
                for (_, r) in &anchor_cols {
                    match r.get(&(op.to_string(), s)) {
                        Some(&ta) => {
                            let theirs = busbw(op, s, n, ta);
                            line += &format!(" {theirs:>10.3} {:>8.2}", mine / theirs);
                        }
                        None => line += &format!(" {:>10} {:>8}", "-", "-"),
                    }
                }
                println!("{line}");
            }
        }
    }
}
