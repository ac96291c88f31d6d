//! Boxing benchmark through the user path `Tensor::to_global` on a 1-d cuda placement of all
//! ranks (one process per GPU, NCCL world from `init_from_env`, a fresh rendezvous store per
//! world), next to the bare collective of the same byte counts on the same communicator:
//!
//! | op (as nccl_bench / dtensor_bench)  | to_global          | bare anchor (`ctx.world()`) |
//! |-------------------------------------|--------------------|-----------------------------|
//! | `S->B all-gather`                   | S(0) -> B          | `all_gather_v`              |
//! | `P->B all-reduce`                   | P -> B             | `all_reduce` (in place)     |
//! | `P->S reduce-scatter`               | P -> S(0)          | `reduce_scatter_v`          |
//! | `S(0)->S(1) all-to-all`             | S(0) -> S(1)       | `all_to_all_v`              |
//!
//! Tensors are f32 [rows, 1024] of 1..1024 MiB. busbw by the nccl-tests rules: all-gather and
//! reduce-scatter bytes/t x (n-1)/n of the whole tensor, all-reduce 2(n-1)/n, S(0)->S(1)
//! reports bytes = the local piece with factor (n-1)/n (as dtensor_bench and nccl_bench, so
//! `scripts/gpu/report.py` merges rows by (world, op, whole size)).
//!
//! Timing: throughput of back-to-back calls (one untimed trial, then 3 trials of `iters` calls,
//! `iters = clamp(4 GiB / bytes, 10, 200)`, host clock with a device synchronize before and
//! after each trial only; the median trial), results dropped each call. `to_global` also gets a
//! latency figure: the median of 20 single calls each followed by a synchronize. Before timing,
//! every case's result is checked on every rank against a host reference (S ops exact, P ops to
//! f32 rounding); a mismatch on any rank skips that case's timing and fails the run (exit 1).
//!
//! Rank 0 prints `RESULT {"world":..,"op":..,"impl":..,"bytes":..,"ms":..,"busbw":..}` lines
//! (impl `oxiflow` = to_global throughput, `oxiflow-latency` = single-call latency, `nccl` = bare
//! collective); the parent collects them, writes the JSON array with `--out FILE` and prints a
//! markdown table at the end.
//!
//! Usage: gpu_boxing_bench [--worlds 2,4] [--sizes-mib 1,4,16,64,256,1024] [--out FILE] [--cpu]
//! [--ops SUBSTRING] (only the ops whose name contains it)
//! [--nccl-memory on|off] (device blocks from NCCL's allocator, registered: on by default)
//! Prints "skipped: no CUDA (...)" without GPUs. `--cpu` runs the same program on a cpu
//! placement over the TCP world (host buffers): a self-check of the bench's own logic
//! (references, counts, output) where there is no GPU; its figures mean nothing.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oxiflow_boxing::{Fill, HostData, HostPiece, LocalPiece};
use oxiflow_collectives::cuda_libs::{self, LibSearch};
use oxiflow_collectives::env::one_host_launch_vars;
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};
use oxiflow_collectives::{ReduceOp, SharedComm};
use oxiflow_cuda::init_from_env;
use oxiflow_cuda::{self as cuda, CudaPiece, CudaRuntime};
use oxiflow_dtype::DType;
use oxiflow_tensor::{DeviceType, GlobalLayout, Placement, Sbp, Shape, Tensor};

type R<T> = Result<T, Box<dyn std::error::Error>>;

/// Columns of every tensor; rows = MiB x 256.
const COLS: usize = 1024;
/// Wall-clock limit of one world's children.
const CHILD_LIMIT: Duration = Duration::from_secs(400);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Waits for the device (a no-op on the cpu self-check).
fn sync(rt: &Option<Arc<CudaRuntime>>) -> R<()> {
    if let Some(rt) = rt {
        rt.synchronize()?;
    }
    Ok(())
}

/// Seconds per call of back-to-back calls: one untimed warm-up trial, then the median of 3
/// trials of `iters`. The warm-up trial runs as far ahead as a timed one, so the caching
/// allocator holds every block a trial keeps in flight (in an NCCL world each new block is
/// also registered with NCCL and mapped by the peers on first use, milliseconds each).
fn throughput(rt: &Option<Arc<CudaRuntime>>, iters: usize, f: &mut dyn FnMut() -> R<()>) -> R<f64> {
    for _ in 0..iters.max(8) {
        f()?;
    }
    let mut trials = Vec::new();
    for _ in 0..3 {
        sync(rt)?;
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        sync(rt)?;
        trials.push(t.elapsed().as_secs_f64() / iters as f64);
    }
    Ok(median(trials))
}

/// Seconds of one call followed by a synchronize: the median of 20.
fn latency(rt: &Option<Arc<CudaRuntime>>, f: &mut dyn FnMut() -> R<()>) -> R<f64> {
    sync(rt)?;
    let mut v = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        f()?;
        sync(rt)?;
        v.push(t.elapsed().as_secs_f64());
    }
    Ok(median(v))
}

/// The elements of `region` ([rows, cols] boxes) of a row-major [_, cols] host array.
fn slice2(full: &[f32], cols: usize, region: &[std::ops::Range<usize>]) -> Vec<f32> {
    let (rr, cc) = (region[0].clone(), region[1].clone());
    let mut out = Vec::with_capacity(rr.len() * cc.len());
    for r in rr {
        out.extend_from_slice(&full[r * cols + cc.start..r * cols + cc.end]);
    }
    out
}

/// None when equal (exactly, or to f32 rounding of a differently ordered sum), else why not.
fn mismatch(got: &[f32], want: &[f32], exact: bool) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} elements vs {} expected", got.len(), want.len()));
    }
    let bad = got.iter().zip(want).position(|(g, w)| {
        if exact {
            g.to_bits() != w.to_bits()
        } else {
            (g - w).abs() > 1e-5 * (1.0 + w.abs()) || g.is_nan()
        }
    })?;
    Some(format!(
        "element {bad} of {}: {} vs {} expected",
        want.len(),
        got[bad],
        want[bad]
    ))
}

/// Whether every rank's check passed (a max all-reduce of the failure flags).
fn all_ok(comm: &SharedComm, dev: DeviceType, ok: bool) -> R<bool> {
    let flag = HostPiece::new([1], HostData::F32(vec![if ok { 0.0 } else { 1.0 }]))?;
    let mut p = CudaPiece::Host(flag).to_device(dev)?;
    comm.all_reduce(DType::F32, p.as_buf_mut(), ReduceOp::Max)?;
    match p.to_device(DeviceType::Cpu)? {
        CudaPiece::Host(HostPiece {
            data: HostData::F32(v),
            ..
        }) => Ok(v.first() == Some(&0.0)),
        _ => Err("flag did not come back to the host".into()),
    }
}

/// One measured boxing: its input, target SBP, host reference of the whole value and the bare
/// collective on pre-allocated buffers.
struct Case<'a> {
    op: &'static str,
    input: &'a Tensor,
    to: Sbp,
    reference: &'a [f32],
    exact: bool,
    /// Bytes reported (whole tensor, or the local piece for S(0)->S(1)).
    bytes: usize,
    factor: f64,
}

/// Pre-allocated device (or host) buffers and the bare collective of one case.
fn bare(
    op: &str,
    comm: &SharedComm,
    dev: DeviceType,
    shape: &Shape,
    pl: &Placement,
    rank: usize,
) -> R<Box<dyn FnMut() -> R<()>>> {
    let world = pl.num_ranks();
    let lay = |s: Sbp| GlobalLayout::new(shape.clone(), pl, s);
    let (s0, s1) = (lay(Sbp::S(0))?, lay(Sbp::S(1))?);
    let numel = |l: &GlobalLayout, j: usize| l.local_shape(j).map_or(0, |s| s.numel());
    let local = |l: &GlobalLayout| l.local_shape(rank).ok_or("rank outside the placement");
    let buf = |s: &Shape| CudaPiece::filled(s, DType::F32, dev, Fill::Zero);
    let comm = comm.clone();
    Ok(match op {
        "S->B all-gather" => {
            let send = buf(&local(&s0)?)?;
            let mut recv = buf(shape)?;
            let counts: Vec<usize> = (0..world).map(|j| numel(&s0, j)).collect();
            Box::new(move || {
                comm.all_gather_v(DType::F32, send.as_buf(), recv.as_buf_mut(), &counts)?;
                Ok(())
            })
        }
        "P->B all-reduce" => {
            let mut b = buf(shape)?;
            Box::new(move || {
                comm.all_reduce(DType::F32, b.as_buf_mut(), ReduceOp::Sum)?;
                Ok(())
            })
        }
        "P->S reduce-scatter" => {
            let send = buf(shape)?;
            let mut recv = buf(&local(&s0)?)?;
            let counts: Vec<usize> = (0..world).map(|j| numel(&s0, j)).collect();
            Box::new(move || {
                comm.reduce_scatter_v(
                    DType::F32,
                    send.as_buf(),
                    recv.as_buf_mut(),
                    &counts,
                    ReduceOp::Sum,
                )?;
                Ok(())
            })
        }
        "S(0)->S(1) all-to-all" => {
            let (ins, outs) = (local(&s0)?, local(&s1)?);
            let send = buf(&ins)?;
            let mut recv = buf(&outs)?;
            // To member j: my rows x j's columns; from member i: i's rows x my columns.
            let sc: Vec<usize> = (0..world)
                .map(|j| s1.local_shape(j).map_or(0, |s| s.dim(1)) * ins.dim(0))
                .collect();
            let rc: Vec<usize> = (0..world)
                .map(|i| s0.local_shape(i).map_or(0, |s| s.dim(0)) * outs.dim(1))
                .collect();
            Box::new(move || {
                comm.all_to_all_v(DType::F32, send.as_buf(), &sc, recv.as_buf_mut(), &rc)?;
                Ok(())
            })
        }
        _ => return Err(format!("unknown op {op}").into()),
    })
}

fn child(rank: usize, world: usize, sizes: &[usize], dev: DeviceType, opts: &Opts) -> R<bool> {
    let ctx = init_from_env()?;
    let rt = match dev {
        DeviceType::Cuda => Some(cuda::bound_runtime().ok_or("no CUDA runtime after init")?),
        _ => None,
    };
    if let Some(r) = &rt {
        r.set_nccl_memory(opts.nccl_memory);
    }
    let comm = ctx.world().clone();
    let pl = Placement::new_1d(dev, (0..world).collect::<Vec<_>>())?;
    let pf = (world - 1) as f64 / world as f64;
    let mut all_passed = true;
    let emit = |op: &str, imp: &str, bytes: usize, secs: f64, factor: f64| {
        let ms = secs * 1e3;
        let busbw = bytes as f64 / secs / 1e9 * factor;
        if rank == 0 {
            println!(
                "RESULT {{\"world\":{world},\"op\":\"{op}\",\"impl\":\"{imp}\",\"bytes\":{bytes},\"ms\":{ms:.5},\"busbw\":{busbw:.2}}}"
            );
        }
        (ms, busbw)
    };
    for (si, &mib) in sizes.iter().enumerate() {
        let bytes = mib << 20;
        let shape = Shape::new([mib * 256, COLS]);
        let n = shape.numel();
        let iters = ((4usize << 30) / bytes.max(1)).clamp(10, 200);
        let seed = 1000 * si as u64 + 7;
        // Host references: the S tensor's whole value, and the sum of every rank's P piece
        // (rank q's piece is randn(seed + 1 + q)); the device inputs come from the same
        // counter-based generator.
        // The S input is the host tensor itself, uploaded whole on every rank (B) and sliced to
        // S(0) locally: device randn may differ from the host's by an ulp, and S checks are
        // exact.
        let xh = Tensor::randn(shape.clone(), seed, DType::F32);
        let xr = xh.to_vec::<f32>()?;
        let x = xh.to_global(&pl, Sbp::B)?.to_global(&pl, Sbp::S(0))?;
        drop(xh);
        let mut psum = vec![0f32; n];
        let mut mine = None;
        for q in 0..world {
            let t = Tensor::randn(shape.clone(), seed + 1 + q as u64, DType::F32);
            for (a, b) in psum.iter_mut().zip(t.to_vec::<f32>()?) {
                *a += b;
            }
            if q == rank {
                mine = Some(t);
            }
        }
        let p = mine
            .ok_or("rank outside the world")?
            .to_global(&pl, Sbp::P)?;
        let cases = [
            Case {
                op: "S->B all-gather",
                input: &x,
                to: Sbp::B,
                reference: &xr,
                exact: true,
                bytes,
                factor: pf,
            },
            Case {
                op: "P->B all-reduce",
                input: &p,
                to: Sbp::B,
                reference: &psum,
                exact: false,
                bytes,
                factor: 2.0 * pf,
            },
            Case {
                op: "P->S reduce-scatter",
                input: &p,
                to: Sbp::S(0),
                reference: &psum,
                exact: false,
                bytes,
                factor: pf,
            },
            Case {
                op: "S(0)->S(1) all-to-all",
                input: &x,
                to: Sbp::S(1),
                reference: &xr,
                exact: true,
                bytes: bytes / world,
                factor: pf,
            },
        ];
        let mut size_ok = true;
        for c in cases
            .iter()
            .filter(|c| opts.ops.as_ref().is_none_or(|o| c.op.contains(o.as_str())))
        {
            // Correctness first, on every rank; all ranks agree before timing.
            let y = c.input.to_global(&pl, c.to)?;
            let region = y
                .layout()
                .and_then(|l| l.region_of(rank))
                .ok_or("result has no piece on this rank")?;
            let got = y.to_local().to_vec::<f32>()?;
            let want = slice2(c.reference, COLS, &region);
            drop(y);
            let bad = mismatch(&got, &want, c.exact);
            if let Some(why) = &bad {
                eprintln!(
                    "gpu_boxing_bench rank {rank}: world {world} {} {mib} MiB: to_global result differs from the host reference: {why}",
                    c.op
                );
            }
            drop((got, want));
            if !all_ok(&comm, dev, bad.is_none())? {
                size_ok = false;
                if rank == 0 {
                    println!("CHECK FAILED world {world} {} {mib} MiB: not timed", c.op);
                }
                continue;
            }
            let mut call = || -> R<()> {
                c.input.to_global(&pl, c.to)?;
                Ok(())
            };
            let t_tp = throughput(&rt, iters, &mut call)?;
            let t_lat = latency(&rt, &mut call)?;
            let mut raw = bare(c.op, &comm, dev, &shape, &pl, rank)?;
            let t_bare = throughput(&rt, iters, &mut *raw)?;
            drop(raw);
            let (ms_tp, bw_tp) = emit(c.op, "oxiflow", c.bytes, t_tp, c.factor);
            let (ms_lat, bw_lat) = emit(c.op, "oxiflow-latency", c.bytes, t_lat, c.factor);
            let (ms_bare, bw_bare) = emit(c.op, "nccl", c.bytes, t_bare, c.factor);
            if rank == 0 {
                println!(
                    "ROW | {world} | {} | {mib} MiB | {bw_tp:.1} | {bw_lat:.1} | {bw_bare:.1} | {:.3} | {ms_tp:.4} | {ms_lat:.4} | {ms_bare:.4} |",
                    c.op,
                    bw_tp / bw_bare
                );
            }
        }
        if rank == 0 && size_ok {
            println!("CHECK world {world} {mib} MiB: to_global results equal the host reference");
        }
        all_passed &= size_ok;
    }
    sync(&rt)?;
    comm.barrier()?;
    Ok(all_passed)
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|s| s.trim().parse().ok()).collect()
}

/// Forwards rank 0's stdout, collecting `RESULT` JSON objects and `ROW` table rows.
fn reader(out: std::process::ChildStdout) -> JoinHandle<(Vec<String>, Vec<String>)> {
    std::thread::spawn(move || {
        let (mut results, mut rows) = (Vec::new(), Vec::new());
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(r) = line.strip_prefix("ROW ") {
                rows.push(r.to_string());
                continue;
            }
            println!("{line}");
            if let Some(j) = line.strip_prefix("RESULT ") {
                results.push(j.to_string());
            }
        }
        (results, rows)
    })
}

/// Waits for every child up to `limit`, then kills the rest; true when all exited with 0.
fn wait_all(kids: &mut [Child], limit: Duration) -> bool {
    let t = Instant::now();
    let mut codes: Vec<Option<bool>> = vec![None; kids.len()];
    while codes.iter().any(Option::is_none) {
        for (k, c) in kids.iter_mut().zip(codes.iter_mut()) {
            if c.is_none() {
                match k.try_wait() {
                    Ok(Some(s)) => *c = Some(s.success()),
                    Ok(None) => {}
                    Err(_) => *c = Some(false),
                }
            }
        }
        if t.elapsed() > limit {
            for (r, (k, c)) in kids.iter_mut().zip(codes.iter_mut()).enumerate() {
                if c.is_none() {
                    eprintln!("gpu_boxing_bench: rank {r} still running after {limit:?}: killed");
                    let _ = k.kill();
                    let _ = k.wait();
                    *c = Some(false);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    codes.iter().all(|c| *c == Some(true))
}

/// Options every child gets: which ops run, and where device blocks come from.
struct Opts {
    ops: Option<String>,
    /// Device blocks from NCCL's allocator, registered (the default of an NCCL world).
    nccl_memory: bool,
}

impl Opts {
    fn parse(args: &[String]) -> Result<Opts, String> {
        let nccl_memory = match arg(args, "--nccl-memory").unwrap_or("on") {
            "on" => true,
            "off" => false,
            s => return Err(format!("--nccl-memory {s}: expected on or off")),
        };
        Ok(Opts {
            ops: arg(args, "--ops").map(str::to_string),
            nccl_memory,
        })
    }
    /// The same options as child arguments.
    fn args(args: &[String]) -> Vec<String> {
        ["--ops", "--nccl-memory"]
            .iter()
            .filter_map(|k| arg(args, k).map(|v| [k.to_string(), v.to_string()]))
            .flatten()
            .collect()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opts = match Opts::parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gpu_boxing_bench: {e}");
            std::process::exit(2);
        }
    };
    let cpu = args.iter().any(|a| a == "--cpu");
    let dev = if cpu {
        DeviceType::Cpu
    } else {
        DeviceType::Cuda
    };
    let sizes = list(arg(&args, "--sizes-mib").unwrap_or("1,4,16,64,256,1024"));
    if args.len() >= 4 && args[1] == "child" {
        let (rank, world) = (args[2].parse().unwrap_or(0), args[3].parse().unwrap_or(0));
        match child(rank, world, &sizes, dev, &opts) {
            Ok(true) => {}
            Ok(false) => std::process::exit(1),
            Err(e) => {
                eprintln!("gpu_boxing_bench rank {rank}: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    let ndev = if cpu {
        usize::MAX
    } else {
        match cuda_libs::probe(&LibSearch::default()).nccl_ready() {
            Ok(n) => n,
            Err(reason) => {
                println!("gpu_boxing_bench: skipped: no CUDA ({reason})");
                return;
            }
        }
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("gpu_boxing_bench: {e}");
            std::process::exit(1);
        }
    };
    let sizes_arg = sizes
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let (mut results, mut rows) = (Vec::new(), Vec::new());
    let mut failed = false;
    for world in list(arg(&args, "--worlds").unwrap_or("2,4")) {
        if world > ndev || world < 2 {
            println!("gpu_boxing_bench: world {world}: skipped: no CUDA ({ndev} GPUs)");
            continue;
        }
        // A fresh store per world (NCCL id keys are per job; see gpu_tensor).
        let (token, server) = match generate_token().map_err(|e| e.to_string()).and_then(|t| {
            StoreServer::bind(([127, 0, 0, 1], 0).into(), t.clone())
                .map(|s| (t, s))
                .map_err(|e| e.to_string())
        }) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("gpu_boxing_bench: store: {e}");
                failed = true;
                continue;
            }
        };
        let addr = server.local_addr();
        let t = Instant::now();
        let mut kids = Vec::new();
        for r in 0..world {
            let mut cmd = Command::new(&exe);
            cmd.args(["child", &r.to_string(), &world.to_string()])
                .args(["--sizes-mib", &sizes_arg])
                .args(Opts::args(&args))
                .envs(one_host_launch_vars(r, world, addr, &token))
                .env("OXIFLOW_BACKEND", if cpu { "cpu" } else { "nccl" })
                .env("OXIFLOW_TIMEOUT", "120")
                .env("NCCL_NVLS_ENABLE", "0")
                .stdout(if r == 0 {
                    Stdio::piped()
                } else {
                    Stdio::null()
                });
            if cpu {
                cmd.arg("--cpu");
            }
            match cmd.spawn() {
                Ok(k) => kids.push(k),
                Err(e) => {
                    eprintln!("gpu_boxing_bench: world {world}: spawning rank {r}: {e}");
                    failed = true;
                }
            }
        }
        let out = kids.first_mut().and_then(|k| k.stdout.take()).map(reader);
        let ok = kids.len() == world && wait_all(&mut kids, CHILD_LIMIT);
        if let Some(h) = out {
            if let Ok((res, rws)) = h.join() {
                results.extend(res);
                rows.extend(rws);
            }
        }
        println!(
            "gpu_boxing_bench: world {world}: {} in {:.1?}",
            if ok { "ok" } else { "FAILED" },
            t.elapsed()
        );
        failed |= !ok;
        drop(server);
    }
    println!();
    println!("| GPUs | boxing | tensor | to_global busbw | to_global latency busbw | bare busbw | to_global/bare | to_global ms | latency ms | bare ms |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    if let Some(path) = arg(&args, "--out") {
        let written =
            std::fs::File::create(path).and_then(|mut f| writeln!(f, "[{}]", results.join(",\n")));
        if let Err(e) = written {
            eprintln!("gpu_boxing_bench: writing {path}: {e}");
            failed = true;
        }
    }
    if failed {
        std::process::exit(1);
    }
}
