//! S(0) -> S(1) boxing of a [rows, 1024] f32 tensor on cuda placements of 2 and 4 GPUs (one
//! process per GPU, NCCL world from `init_from_env`): the boxing executor on `CudaPiece`s
//! (strided-copy pack + all-to-all), the same through `Tensor::to_global`, and the bare
//! all-to-all of the same buffers. busbw = (n-1)/n x local piece / time (nccl-tests rules).
//! Usage: gpu_boxing_bench [--worlds 2,4] [--sizes-mib 1,4,16,64,256,1024]
//! Prints "skipped: no CUDA (...)" without GPUs.

use std::process::Command;
use std::time::{Duration, Instant};

use oxiflow_boxing::{execute, BoxingPlanner, LocalPiece};
use oxiflow_collectives::cuda_libs::{self, LibSearch};
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};
use oxiflow_collectives::DType;
use oxiflow_tensor::cuda::{self, CudaPiece, CudaStorage};
use oxiflow_tensor::{
    init_from_env, DeviceType, GlobalLayout, NdSbp, Placement, Sbp, Shape, Storage, Tensor,
};

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time_it(rt: &cuda::CudaRuntime, iters: usize, mut f: impl FnMut() -> R<()>) -> R<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut trials = Vec::new();
    for _ in 0..3 {
        rt.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        rt.synchronize()?;
        trials.push(t.elapsed().as_secs_f64() / iters as f64);
    }
    Ok(median(trials))
}

fn child(rank: usize, world: usize, sizes: &[usize]) -> R<()> {
    let ctx = init_from_env()?;
    let rt = cuda::bound_runtime().ok_or("no CUDA runtime after init")?;
    let comm = ctx.world().clone();
    let pl = Placement::new_1d(DeviceType::Cuda, (0..world).collect::<Vec<_>>())?;
    let planner = BoxingPlanner::new();
    for &mib in sizes {
        let shape = Shape::new([mib * 256, 1024]);
        let from = GlobalLayout::new(shape.clone(), &pl, NdSbp::new([Sbp::S(0)]))?;
        let to = GlobalLayout::new(shape.clone(), &pl, NdSbp::new([Sbp::S(1)]))?;
        let plan = planner.plan(&from, &to, DType::F32)?;
        let x = Tensor::randn_global(shape.clone(), 5, DType::F32, &pl, Sbp::S(0))?;
        let cs: CudaStorage = match x.storage() {
            Some(Storage::Device(d)) => d
                .as_any()
                .downcast_ref::<CudaStorage>()
                .cloned()
                .ok_or("not CUDA storage")?,
            _ => return Err("input is not on the device".into()),
        };
        let in_shape = from.local_shape(rank).ok_or("no local piece")?;
        let out_shape = to.local_shape(rank).ok_or("no local piece")?;
        let local_bytes = in_shape.numel() * 4;
        let iters = ((4usize << 30) / local_bytes.max(1)).clamp(10, 200);
        // Check once: the executor's result equals the tensor path's.
        let via_exec = execute(&plan, &comm, Some(CudaPiece::from_storage(&cs, false)?))?
            .ok_or("no output")?;
        let via_exec = Tensor::from_storage(Storage::Device(std::sync::Arc::new(
            via_exec.into_storage().map_err(|_| "host output")?,
        )));
        let via_tensor = x.to_global(&pl, Sbp::S(1))?.to_local();
        if via_exec.to_vec::<f32>()? != via_tensor.to_vec::<f32>()? {
            return Err(format!("{mib} MiB: executor and tensor path disagree").into());
        }
        let t_exec = time_it(&rt, iters, || {
            execute(&plan, &comm, Some(CudaPiece::from_storage(&cs, false)?))?;
            Ok(())
        })?;
        let t_tensor = time_it(&rt, iters, || {
            x.to_global(&pl, Sbp::S(1))?;
            Ok(())
        })?;
        let send = CudaPiece::alloc(&in_shape, DType::F32, DeviceType::Cuda)?;
        let mut recv = CudaPiece::alloc(&out_shape, DType::F32, DeviceType::Cuda)?;
        let cols: Vec<usize> = (0..world)
            .map(|j| to.local_shape(j).map_or(0, |s| s.dim(1)))
            .collect();
        let rows: Vec<usize> = (0..world)
            .map(|j| from.local_shape(j).map_or(0, |s| s.dim(0)))
            .collect();
        let sc: Vec<usize> = cols.iter().map(|c| c * in_shape.dim(0)).collect();
        let rc: Vec<usize> = rows.iter().map(|r| r * out_shape.dim(1)).collect();
        let t_bare = time_it(&rt, iters, || {
            comm.all_to_all_v(DType::F32, send.as_buf(), &sc, recv.as_buf_mut(), &rc)?;
            Ok(())
        })?;
        let bw = |t: f64| (world - 1) as f64 / world as f64 * local_bytes as f64 / t / 1e9;
        if rank == 0 {
            println!(
                "| {world} | S(0)->S(1) executor | {mib} MiB | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {:.5} |",
                bw(t_exec), bw(t_tensor), bw(t_bare), t_exec.recip() / t_bare.recip(), t_tensor.recip() / t_bare.recip(), t_exec * 1e3
            );
        }
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: &str| -> Vec<usize> {
        let v = args
            .iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |s| s.as_str());
        v.split(',').filter_map(|s| s.trim().parse().ok()).collect()
    };
    let sizes = arg("--sizes-mib", "1,4,16,64,256,1024");
    if args.len() >= 4 && args[1] == "child" {
        let (rank, world) = (args[2].parse().unwrap_or(0), args[3].parse().unwrap_or(0));
        if let Err(e) = child(rank, world, &sizes) {
            eprintln!("gpu_boxing_bench rank {rank}: {e}");
            std::process::exit(1);
        }
        return;
    }
    let ndev = match cuda_libs::probe(&LibSearch::default()).nccl_ready() {
        Ok(n) => n,
        Err(reason) => {
            println!("gpu_boxing_bench: skipped: no CUDA ({reason})");
            return;
        }
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("gpu_boxing_bench: {e}");
            std::process::exit(1);
        }
    };
    println!("| GPUs | boxing | tensor | executor busbw | Tensor::to_global busbw | bare all-to-all busbw | executor/bare | to_global/bare | executor ms |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut failed = false;
    for world in arg("--worlds", "2,4") {
        if world > ndev {
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
        let kids: Vec<_> = (0..world)
            .filter_map(|r| {
                Command::new(&exe)
                    .args(["child", &r.to_string(), &world.to_string(), "--sizes-mib"])
                    .arg(
                        sizes
                            .iter()
                            .map(|s| s.to_string())
                            .collect::<Vec<_>>()
                            .join(","),
                    )
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("LOCAL_RANK", r.to_string())
                    .env("LOCAL_WORLD_SIZE", world.to_string())
                    .env("MASTER_ADDR", addr.ip().to_string())
                    .env("MASTER_PORT", addr.port().to_string())
                    .env("OXIFLOW_TOKEN", &token)
                    .env("OXIFLOW_BACKEND", "nccl")
                    .env("NCCL_NVLS_ENABLE", "0")
                    .spawn()
                    .ok()
            })
            .collect();
        let t = Instant::now();
        for mut k in kids {
            loop {
                match k.try_wait() {
                    Ok(Some(s)) => {
                        failed |= !s.success();
                        break;
                    }
                    Ok(None) if t.elapsed() < Duration::from_secs(400) => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    _ => {
                        let _ = k.kill();
                        let _ = k.wait();
                        failed = true;
                        break;
                    }
                }
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
