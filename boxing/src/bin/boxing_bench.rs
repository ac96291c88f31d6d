//! `boxing_bench`: executed boxing vs the bare collective for S->B, P->B, P->S and S->S of one
//! f32 tensor (default 64 MiB, `--kib` to change) on 4 ranks of the CPU backend: TCP processes (the binary starts
//! itself once per rank, with a rendezvous store it serves) or in-process threads. Prints the
//! median time of each and their ratio. Both sides allocate their output as boxing does.
//! Allocations of 16 MiB outputs dominate at 64 MiB: glibc's dynamic mmap threshold decides
//! whether they page-fault on every call, from the process's allocation history, so compare
//! binaries in a pinned regime (workers inherit the environment): no faults with
//! `MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000`, faults on every call
//! with `MALLOC_MMAP_THRESHOLD_=131072`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use oxiflow_boxing::{boxing, BoxingPlanner, HostData, HostPiece, LocalPiece};
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};
use oxiflow_collectives::{
    init_world, Buf, BufMut, InProcessWorld, ReduceOp, SharedComm, StridedBlock,
};
use oxiflow_dtype::DType;
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{GlobalLayout, Sbp};

#[derive(Parser, Debug, Clone)]
#[command(about = "Executed boxing vs the bare collective on the CPU backend")]
struct Args {
    /// Number of ranks.
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Logical tensor size in KiB (f32; shape [n/4096, 4096], or [n/64, 64] below 1 MiB).
    #[arg(long, default_value_t = 64 * 1024)]
    kib: usize,
    /// Timed iterations of each variant (medians are reported).
    #[arg(long, default_value_t = 9)]
    iters: usize,
    /// `tcp` (one process per rank) or `inprocess` (one thread per rank).
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// Internal: run as one rank of a TCP world started by the parent.
    #[arg(long, hide = true)]
    worker: bool,
}

#[derive(Clone, Copy)]
enum Op {
    SToB,
    PToB,
    PToS,
    SToS,
}

impl Op {
    fn all() -> [Op; 4] {
        [Op::SToB, Op::PToB, Op::PToS, Op::SToS]
    }
    fn sbps(self) -> (Sbp, Sbp) {
        match self {
            Op::SToB => (Sbp::S(0), Sbp::B),
            Op::PToB => (Sbp::P, Sbp::B),
            Op::PToS => (Sbp::P, Sbp::S(0)),
            Op::SToS => (Sbp::S(0), Sbp::S(1)),
        }
    }
    fn bare_name(self) -> &'static str {
        match self {
            Op::SToB => "all_gather",
            Op::PToB => "all_reduce",
            Op::PToS => "reduce_scatter",
            Op::SToS => "all_to_all_v",
        }
    }
}

fn f32s(p: &mut HostPiece) -> &mut [u8] {
    match p.as_buf_mut() {
        BufMut::Host(b) => b,
        BufMut::Device(_) => &mut [],
    }
}

/// The hand-written S(0) -> S(1) a user would call without boxing: pack the column blocks
/// (row-major, so they are strided) into a preallocated buffer, then all-to-all-v.
fn bare_pack_all_to_all(
    comm: &SharedComm,
    piece: &HostPiece,
    packed: &mut [f32],
    out_numel: usize,
) -> Result<Vec<f32>, String> {
    let p = comm.size();
    let HostData::F32(v) = &piece.data else {
        return Err("f32 expected".into());
    };
    let (rows, cols) = (piece.shape.dim(0), piece.shape.dim(1));
    let w = cols / p;
    let mut at = 0;
    for j in 0..p {
        for r in 0..rows {
            packed[at..at + w].copy_from_slice(&v[r * cols + j * w..r * cols + (j + 1) * w]);
            at += w;
        }
    }
    let mut out = vec![0f32; out_numel];
    let counts = vec![rows * w; p];
    comm.all_to_all_v(
        DType::F32,
        Buf::Host(bytemuck::cast_slice(packed)),
        &counts,
        BufMut::Host(bytemuck::cast_slice_mut(&mut out)),
        &counts,
    )
    .map_err(|e| e.to_string())?;
    Ok(out)
}

/// The strided all-to-all called by hand: each column block described as strided runs.
fn bare_strided_all_to_all(
    comm: &SharedComm,
    piece: &HostPiece,
    out_numel: usize,
) -> Result<Vec<f32>, String> {
    let p = comm.size();
    let (rows, cols) = (piece.shape.dim(0), piece.shape.dim(1));
    let w = cols / p;
    let layout: Vec<StridedBlock> = (0..p)
        .map(|j| StridedBlock {
            offset: j * w,
            run_len: w,
            stride: cols,
            runs: rows,
        })
        .collect();
    let mut out = vec![0f32; out_numel];
    comm.all_to_all_v_strided(
        DType::F32,
        piece.as_buf(),
        &layout,
        BufMut::Host(bytemuck::cast_slice_mut(&mut out)),
        &vec![rows * w; p],
    )
    .map_err(|e| e.to_string())?;
    Ok(out)
}

fn bare(
    comm: &SharedComm,
    op: Op,
    mut piece: HostPiece,
    out_numel: usize,
) -> Result<HostPiece, String> {
    let p = comm.size();
    let mut out = vec![0f32; out_numel];
    let recv = BufMut::Host(bytemuck::cast_slice_mut(&mut out));
    let r = match op {
        Op::SToB => comm.all_gather(DType::F32, piece.as_buf(), recv),
        Op::PToB => comm.all_reduce(DType::F32, BufMut::Host(f32s(&mut piece)), ReduceOp::Sum),
        Op::PToS => comm.reduce_scatter(DType::F32, piece.as_buf(), recv, ReduceOp::Sum),
        Op::SToS => {
            let n = piece.shape.numel() / p;
            let counts = vec![n; p];
            let send: Buf<'_> = piece.as_buf();
            comm.all_to_all_v(DType::F32, send, &counts, recv, &counts)
        }
    };
    r.map_err(|e| e.to_string())?;
    Ok(piece)
}

fn shape_of(kib: usize) -> [usize; 2] {
    let elems = kib * 256;
    let cols = if elems >= 4096 * 64 { 4096 } else { 64 };
    [elems / cols, cols]
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the benchmark on one rank; rank 0 returns the report.
fn bench_rank(comm: SharedComm, args: &Args) -> Result<Option<String>, String> {
    let n = comm.size();
    let me = comm.rank();
    let pl = Placement::range(DeviceType::Cpu, n).map_err(|e| e.to_string())?;
    let shape = shape_of(args.kib);
    let planner = BoxingPlanner::new();
    let mut report = String::new();
    for op in Op::all() {
        let (a, b) = op.sbps();
        let from = GlobalLayout::new(shape, &pl, a).map_err(|e| e.to_string())?;
        let to = GlobalLayout::new(shape, &pl, b).map_err(|e| e.to_string())?;
        let plan = planner
            .plan(&from, &to, DType::F32)
            .map_err(|e| e.to_string())?;
        let local = from.local_shape(me).ok_or("rank outside placement")?;
        let out_numel = to.local_shape(me).ok_or("rank outside placement")?.numel();
        let input = HostPiece::new(
            local.clone(),
            HostData::F32((0..local.numel()).map(|i| ((i + me) % 17) as f32).collect()),
        )
        .map_err(|e| e.to_string())?;
        let (mut tb, mut tc, mut tp, mut ts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut packed = vec![
            0f32;
            if matches!(op, Op::SToS) {
                local.numel()
            } else {
                0
            }
        ];
        let variants: &[usize] = if matches!(op, Op::SToS) {
            &[0, 1, 2, 3]
        } else {
            &[0, 1]
        };
        for it in 0..args.iters + 1 {
            for k in 0..variants.len() {
                let variant = variants[(k + it) % variants.len()];
                let piece = input.clone();
                comm.barrier().map_err(|e| e.to_string())?;
                let t0 = Instant::now();
                if variant == 0 {
                    // The cached plan lookup is part of every op's hot path: time it too.
                    let out = boxing(&planner, &comm, &from, &to, DType::F32, Some(piece))
                        .map_err(|e| e.to_string())?;
                    std::hint::black_box(out);
                } else if variant == 1 {
                    std::hint::black_box(bare(&comm, op, piece, out_numel)?);
                } else if variant == 3 {
                    std::hint::black_box(bare_strided_all_to_all(&comm, &piece, out_numel)?);
                } else {
                    std::hint::black_box(bare_pack_all_to_all(
                        &comm,
                        &piece,
                        &mut packed,
                        out_numel,
                    )?);
                }
                // The slowest rank defines the time.
                let mut t = [t0.elapsed().as_secs_f64()];
                comm.all_reduce(
                    DType::F64,
                    BufMut::Host(bytemuck::cast_slice_mut(&mut t)),
                    ReduceOp::Max,
                )
                .map_err(|e| e.to_string())?;
                if it > 0 {
                    [&mut tb, &mut tc, &mut tp, &mut ts][variant].push(t[0]);
                }
            }
        }
        let mb = median(&mut tb);
        // Boxing's median beside a bare variant's (`bare` seconds).
        let mut line = |name: &str, bare: f64| {
            report.push_str(&format!(
                "{:<12} boxing {:>9.3} ms   bare {:<14} {:>9.3} ms   ratio {:.3}\n",
                format!("{a}->{b}"),
                mb * 1e3,
                name,
                bare * 1e3,
                mb / bare
            ))
        };
        line(op.bare_name(), median(&mut tc));
        if !tp.is_empty() {
            line("pack+a2a_v", median(&mut tp));
        }
        if !ts.is_empty() {
            line("strided a2a_v", median(&mut ts));
        }
        if me == 0 && op as u8 == 0 {
            report.insert_str(0, &plan.explain());
        }
    }
    Ok((me == 0).then_some(report))
}

fn worker(args: &Args) -> Result<(), String> {
    // The parent passed the launch contract (RANK, MASTER_PORT, OXIFLOW_TOKEN, ...) in the
    // environment, which collectives::env reads.
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let comm = init_world(&env).map_err(|e| e.to_string())?;
    if let Some(r) = bench_rank(comm, args)? {
        print!("{r}");
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    if args.worker {
        if let Err(e) = worker(&args) {
            eprintln!("worker: {e}");
            std::process::exit(1);
        }
        return;
    }
    println!(
        "boxing_bench: {} KiB f32 {:?}, {} ranks, backend {}, {} iterations, medians",
        args.kib,
        shape_of(args.kib),
        args.ranks,
        if args.backend == "tcp" {
            "cpu (TCP processes)"
        } else {
            "in-process threads"
        },
        args.iters
    );
    let code = if args.backend == "tcp" {
        run_tcp(&args)
    } else {
        run_threads(&args)
    };
    if let Err(e) = code {
        eprintln!("boxing_bench: {e}");
        std::process::exit(1);
    }
}

fn run_threads(args: &Args) -> Result<(), String> {
    let comms = InProcessWorld::new(args.ranks, Duration::from_secs(120));
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let a = args.clone();
            std::thread::spawn(move || bench_rank(c, &a))
        })
        .collect();
    for h in hs {
        if let Some(r) = h.join().map_err(|_| "rank thread panicked")?? {
            print!("{r}");
        }
    }
    Ok(())
}

fn run_tcp(args: &Args) -> Result<(), String> {
    let token = generate_token().map_err(|e| e.to_string())?;
    let server = StoreServer::bind("127.0.0.1:0".parse().map_err(|_| "addr")?, token.clone())
        .map_err(|e| e.to_string())?;
    let port = server.local_addr().port();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let children: Vec<_> = (0..args.ranks)
        .map(|r| {
            Command::new(&exe)
                .args([
                    "--ranks",
                    &args.ranks.to_string(),
                    "--kib",
                    &args.kib.to_string(),
                    "--iters",
                    &args.iters.to_string(),
                    "--worker",
                ])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", args.ranks.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", args.ranks.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OXIFLOW_TOKEN", &token)
                .env("OXIFLOW_TIMEOUT", "120")
                .env("OXIFLOW_BACKEND", "cpu")
                .stdout(Stdio::inherit())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut failed = false;
    for mut c in children {
        failed |= !c.wait().map_err(|e| e.to_string())?.success();
    }
    drop(server);
    if failed {
        return Err("a rank failed".into());
    }
    Ok(())
}
