//! GPU suite of the NCCL backend: proptest-generated collectives on 2 and 4 ranks (one process
//! per GPU, meeting through the real rendezvous store), compared with a CPU reference, plus
//! the watchdog turning a dead peer into an error. Prints "skipped: no CUDA (...)" without GPUs.
//!
//! A custom harness (`harness = false`): the parent re-runs this binary once per rank.

use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxiflow_collectives::cuda_libs::{self, CudaLib, LibSearch};
use oxiflow_collectives::nccl::{Completion, DeviceBytes, IdExchange, NcclComm, NcclOptions};
use oxiflow_collectives::rendezvous::{generate_token, StoreClient, StoreServer};
use oxiflow_collectives::{reduce_into, CommError, Communicator, DType, ReduceOp};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

mod rank_processes;
use rank_processes::{gpu_cases, ranks_failed};

const KINDS: usize = 8;

#[derive(Clone, Debug)]
struct Case {
    kind: usize,
    dtype: DType,
    op: ReduceOp,
    counts: Vec<usize>,
    matrix: Vec<Vec<usize>>,
    root: usize,
    members: Vec<usize>,
    asynchronous: bool,
}

fn case_strategy(world: usize) -> impl Strategy<Value = Case> {
    let count = prop_oneof![8 => 0usize..3000, 1 => Just(0usize), 1 => 60_000usize..300_000];
    (
        0..KINDS,
        0..5usize,
        0..3usize,
        prop::collection::vec(count.clone(), world),
        any::<bool>(),
        prop::collection::vec(prop::collection::vec(0usize..2000, world), world),
        0..world,
        Just((0..world).collect::<Vec<_>>()).prop_shuffle(),
        1..=world,
        any::<bool>(),
    )
        .prop_map(
            |(kind, d, o, mut counts, equal, matrix, root, perm, k, asynchronous)| {
                if equal {
                    let c = counts[0];
                    counts.iter_mut().for_each(|x| *x = c);
                }
                Case {
                    kind,
                    dtype: [DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16][d],
                    op: [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][o],
                    counts,
                    matrix,
                    root,
                    members: perm[..k].to_vec(),
                    asynchronous,
                }
            },
        )
}

/// Small integers, exact in every dtype and under every reduction of up to 4 ranks (16-bit
/// floats: |sum| < 256, so NCCL's per-step rounding and the host's agree exactly).
fn data(dtype: DType, case: usize, rank: usize, n: usize) -> Vec<u8> {
    let v = |i: usize| ((case * 1009 + rank * 131 + i * 7) % 199) as i64 - 99;
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        match dtype {
            DType::F32 => out.extend_from_slice(&(v(i) as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&(v(i) as f64).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&v(i).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(
                &oxiflow_dtype::bf16::from_f32((v(i) % 63) as f32).to_le_bytes(),
            ),
            DType::F16 => out
                .extend_from_slice(&oxiflow_dtype::f16::from_f32((v(i) % 63) as f32).to_le_bytes()),
        }
    }
    out
}

fn reduced(dtype: DType, op: ReduceOp, parts: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        reduce_into(dtype, &mut acc, p, op);
    }
    acc
}

struct Rank {
    comm: NcclComm,
    stream: Arc<cudarc::driver::CudaStream>,
    /// Buffers from NCCL's allocator (registered with each comm on first use).
    nccl_memory: bool,
}

impl Rank {
    fn up(&self, host: &[u8]) -> DeviceBytes {
        if self.nccl_memory {
            DeviceBytes::from_host_nccl(&self.stream, host).expect("upload")
        } else {
            DeviceBytes::from_host(&self.stream, host).expect("upload")
        }
    }
    fn zeros(&self, len: usize) -> Result<DeviceBytes, CommError> {
        if self.nccl_memory {
            DeviceBytes::zeros_nccl(&self.stream, len)
        } else {
            DeviceBytes::zeros(&self.stream, len)
        }
    }
}

/// (expected, got) bytes of one rank's result.
type Expected = (Vec<u8>, Vec<u8>);

/// Runs one case on `c` (rank `me` of `w`) and returns (expected, got) for this rank, or None
/// when this rank has nothing to check.
fn run_case(
    r: &Rank,
    c: &dyn Communicator,
    ci: usize,
    case: &Case,
) -> Result<Option<Expected>, CommError> {
    let me = c.rank();
    let w = c.size();
    let dt = case.dtype;
    let esz = dt.size();
    let n = case.counts[0];
    match case.kind {
        0 => {
            let parts: Vec<_> = (0..w).map(|q| data(dt, ci, q, n)).collect();
            let mut b = r.up(&parts[me]);
            c.all_reduce(dt, b.as_buf_mut(), case.op)?;
            let want = reduced(dt, case.op, &parts);
            let mut got = b.to_host()?;
            // Out of place: the result lands in another buffer and the input stays.
            let s = r.up(&parts[me]);
            let mut o = r.zeros(n * esz)?;
            c.all_reduce_into(dt, s.as_buf(), o.as_buf_mut(), case.op)?;
            got.extend(o.to_host()?);
            got.extend(s.to_host()?);
            Ok(Some((
                [want.clone(), want, parts[me].clone()].concat(),
                got,
            )))
        }
        1 => {
            let parts: Vec<_> = (0..w).map(|q| data(dt, ci, q, case.counts[q])).collect();
            let s = r.up(&parts[me]);
            let mut o = r.zeros(case.counts.iter().sum::<usize>() * esz)?;
            c.all_gather_v(dt, s.as_buf(), o.as_buf_mut(), &case.counts)?;
            Ok(Some((parts.concat(), o.to_host()?)))
        }
        2 => {
            let total: usize = case.counts.iter().sum();
            let parts: Vec<_> = (0..w).map(|q| data(dt, ci, q, total)).collect();
            let off: usize = case.counts[..me].iter().sum::<usize>() * esz;
            let mine: Vec<_> = parts
                .iter()
                .map(|p| p[off..off + case.counts[me] * esz].to_vec())
                .collect();
            let s = r.up(&parts[me]);
            let mut o = r.zeros(case.counts[me] * esz)?;
            c.reduce_scatter_v(dt, s.as_buf(), o.as_buf_mut(), &case.counts, case.op)?;
            Ok(Some((reduced(dt, case.op, &mine), o.to_host()?)))
        }
        3 => {
            let mut m = case.matrix.clone();
            for (q, row) in m.iter_mut().enumerate() {
                row.truncate(w);
                let _ = q;
            }
            let parts: Vec<_> = (0..w).map(|q| data(dt, ci, q, m[q].iter().sum())).collect();
            let mut expect = Vec::new();
            for (q, part) in parts.iter().enumerate() {
                let off = m[q][..me].iter().sum::<usize>() * esz;
                expect.extend_from_slice(&part[off..off + m[q][me] * esz]);
            }
            let recv_counts: Vec<usize> = (0..w).map(|q| m[q][me]).collect();
            let s = r.up(&parts[me]);
            let mut o = r.zeros(expect.len())?;
            c.all_to_all_v(dt, s.as_buf(), &m[me], o.as_buf_mut(), &recv_counts)?;
            let mut got = o.to_host()?;
            // Without the own part: it is not sent, and its region of recv stays as it was.
            let own_s = m[me][..me].iter().sum::<usize>() * esz;
            let own_n = m[me][me] * esz;
            let others = [&parts[me][..own_s], &parts[me][own_s + own_n..]].concat();
            let keep = data(dt, ci + 7, me, expect.len() / esz);
            let own_r = recv_counts[..me].iter().sum::<usize>() * esz;
            let mut want = expect.clone();
            want[own_r..own_r + own_n].copy_from_slice(&keep[own_r..own_r + own_n]);
            let s2 = r.up(&others);
            let mut o2 = r.up(&keep);
            c.all_to_all_v_others(dt, s2.as_buf(), &m[me], o2.as_buf_mut(), &recv_counts)?;
            got.extend(o2.to_host()?);
            Ok(Some(([expect, want].concat(), got)))
        }
        4 => {
            let mut b = r.up(&data(dt, ci, me, n));
            c.broadcast(dt, b.as_buf_mut(), case.root)?;
            Ok(Some((data(dt, ci, case.root, n), b.to_host()?)))
        }
        5 => {
            let parts: Vec<_> = (0..w).map(|q| data(dt, ci, q, n)).collect();
            let mut b = r.up(&parts[me]);
            c.reduce(dt, b.as_buf_mut(), case.root, case.op)?;
            let got = b.to_host()?;
            Ok((me == case.root).then(|| (reduced(dt, case.op, &parts), got)))
        }
        6 => {
            let next = (me + 1) % w;
            let prev = (me + w - 1) % w;
            let s = r.up(&data(dt, ci, me, n));
            let mut o = r.zeros(n * esz)?;
            if me.is_multiple_of(2) {
                c.send(dt, s.as_buf(), next)?;
                c.recv(dt, o.as_buf_mut(), prev)?;
            } else {
                c.recv(dt, o.as_buf_mut(), prev)?;
                c.send(dt, s.as_buf(), next)?;
            }
            Ok(Some((data(dt, ci, prev, n), o.to_host()?)))
        }
        _ => {
            // Sub-group: all-reduce then uneven all-gather among `members`, in their order.
            if !case.members.contains(&me) {
                return Ok(None);
            }
            let sub = c.sub_group(&case.members)?;
            let again = c.sub_group(&case.members)?;
            assert!(Arc::ptr_eq(&sub, &again), "sub_group is cached");
            let sw = sub.size();
            let world_of: Vec<usize> = case.members.clone();
            let parts: Vec<_> = world_of.iter().map(|&q| data(dt, ci, q, n)).collect();
            let mut b = r.up(&parts[sub.rank()]);
            sub.all_reduce(dt, b.as_buf_mut(), case.op)?;
            let mut expect = reduced(dt, case.op, &parts);
            let mut got = b.to_host()?;
            let counts: Vec<usize> = case.counts[..sw].to_vec();
            let gparts: Vec<_> = world_of
                .iter()
                .enumerate()
                .map(|(i, &q)| data(dt, ci + 1, q, counts[i]))
                .collect();
            let s = r.up(&gparts[sub.rank()]);
            let mut o = r.zeros(counts.iter().sum::<usize>() * esz)?;
            sub.all_gather_v(dt, s.as_buf(), o.as_buf_mut(), &counts)?;
            expect.extend(gparts.concat());
            got.extend(o.to_host()?);
            Ok(Some((expect, got)))
        }
    }
}

fn connect(addr: &str, token: &str) -> Arc<dyn IdExchange> {
    Arc::new(StoreClient::connect(addr, token, Duration::from_secs(30)).expect("store connect"))
}

fn init(
    scenario: &str,
    rank: usize,
    world: usize,
    addr: &str,
    token: &str,
    timeout: Duration,
) -> NcclComm {
    let opts = NcclOptions {
        job: format!("{scenario}-w{world}"),
        timeout,
        ..NcclOptions::default()
    };
    NcclComm::init_with(connect(addr, token), rank, world, rank, &opts).expect("nccl init")
}

fn child_cases(rank: usize, world: usize, addr: &str, token: &str, cases: u32, nccl_memory: bool) {
    let scenario = if nccl_memory { "registered" } else { "cases" };
    let comm = init(scenario, rank, world, addr, token, Duration::from_secs(60));
    let (ver, path) = comm.library();
    if rank == 0 {
        println!("nccl {ver} from {path}; world {world}");
    }
    let r = Rank {
        stream: comm.compute_stream(),
        comm: comm.clone(),
        nccl_memory,
    };
    let mut runner = TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7u8; 32]),
    );
    let strat = case_strategy(world);
    let mut per_kind = [0usize; KINDS];
    for ci in 0..cases as usize {
        let case = strat.new_tree(&mut runner).expect("case").current();
        r.comm.set_completion(if case.asynchronous {
            Completion::Async
        } else {
            Completion::Blocking
        });
        match run_case(&r, &r.comm, ci, &case) {
            Ok(Some((expect, got))) => {
                if expect != got {
                    let first = expect.iter().zip(&got).position(|(a, b)| a != b);
                    eprintln!("rank {rank}: case {ci} MISMATCH {case:?}: lens {} vs {}, first diff byte {first:?}", expect.len(), got.len());
                    std::process::exit(3);
                }
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("rank {rank}: case {ci} ERROR {e} in {case:?}");
                std::process::exit(4);
            }
        }
        per_kind[case.kind] += 1;
    }
    r.comm.synchronize().expect("synchronize");
    r.comm.barrier().expect("barrier");
    if rank == 0 {
        let mem = if nccl_memory {
            " on registered NCCL memory"
        } else {
            ""
        };
        println!("world {world}: {cases} cases passed{mem} (per kind {per_kind:?}: all_reduce + all_reduce_into, all_gather_v, reduce_scatter_v, all_to_all_v + all_to_all_v_others, broadcast, reduce, send/recv, sub_group)");
    }
}

fn child_dead_peer(rank: usize, world: usize, addr: &str, token: &str) {
    let timeout = Duration::from_secs(8);
    let comm = init("dead", rank, world, addr, token, timeout);
    comm.barrier().expect("barrier");
    if rank == world - 1 {
        // Dies without taking part in the next collective.
        std::process::exit(0);
    }
    let mut b = DeviceBytes::zeros(&comm.compute_stream(), 64 << 20).expect("alloc");
    let t = Instant::now();
    let r = comm.all_reduce(DType::F32, b.as_buf_mut(), ReduceOp::Sum);
    let el = t.elapsed();
    match r {
        Err(e) if el < timeout + Duration::from_secs(20) => {
            println!("dead peer: rank {rank} got an error after {el:?}: {e}");
            let again = comm.all_reduce(DType::F32, b.as_buf_mut(), ReduceOp::Sum);
            assert!(again.is_err(), "a failed communicator stays failed");
            std::process::exit(0);
        }
        other => {
            eprintln!("dead peer: rank {rank} expected an error within the timeout, got {other:?} after {el:?}");
            std::process::exit(5);
        }
    }
}

fn spawn_all(scenario: &str, world: usize, addr: &str, token: &str, cases: u32) -> Vec<Child> {
    let exe = std::env::current_exe().expect("current_exe");
    (0..world)
        .map(|r| {
            Command::new(&exe)
                .args([
                    "child",
                    scenario,
                    &r.to_string(),
                    &world.to_string(),
                    addr,
                    token,
                    &cases.to_string(),
                ])
                .env("NCCL_NVLS_ENABLE", "0")
                .spawn()
                .expect("spawn rank")
        })
        .collect()
}

/// NCCL installed only as `libnccl.so.2` (a name cudarc never tries) still loads: a folder
/// holding just that name is searched alone.
fn so2_only(found: &std::path::Path) -> Result<String, String> {
    let real = if found.is_absolute() {
        found.canonicalize().map_err(|e| e.to_string())?
    } else {
        cuda_libs::DEFAULT_DIRS
            .iter()
            .map(|d| std::path::Path::new(d).join(found))
            .find(|p| p.exists())
            .ok_or("cannot resolve the NCCL path")?
            .canonicalize()
            .map_err(|e| e.to_string())?
    };
    let dir = std::env::temp_dir().join(format!("oxiflow-so2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let link = dir.join("libnccl.so.2");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&real, &link).map_err(|e| e.to_string())?;
    let search = LibSearch {
        extra_dirs: vec![dir.clone()],
        only_extra: true,
    };
    let lib = cuda_libs::load_uncached(CudaLib::Nccl, &search).map_err(|e| e.to_string())?;
    if lib.path != link {
        return Err(format!(
            "loaded {} instead of {}",
            lib.path.display(),
            link.display()
        ));
    }
    let f = lib.symbol("ncclGetVersion").ok_or("no ncclGetVersion")?;
    let mut v = 0i32;
    // SAFETY: ncclGetVersion(int*).
    let r = unsafe {
        std::mem::transmute::<*mut std::ffi::c_void, extern "C" fn(*mut i32) -> i32>(f)(&mut v)
    };
    let _ = std::fs::remove_dir_all(&dir);
    if r != 0 {
        return Err(format!("ncclGetVersion returned {r}"));
    }
    Ok(format!(
        "NCCL {v} loaded from {} (only libnccl.so.2 -> {})",
        link.display(),
        real.display()
    ))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() >= 8 && args[1] == "child" {
        let rank: usize = args[3].parse().expect("rank");
        let world: usize = args[4].parse().expect("world");
        let cases: u32 = args[7].parse().expect("cases");
        match args[2].as_str() {
            "cases" => child_cases(rank, world, &args[5], &args[6], cases, false),
            "registered" => child_cases(rank, world, &args[5], &args[6], cases, true),
            "dead" => child_dead_peer(rank, world, &args[5], &args[6]),
            s => panic!("unknown scenario {s}"),
        }
        return;
    }
    // Parent. `cargo test` passes harness flags; they are ignored.
    let report = cuda_libs::probe(&LibSearch::default());
    let ndev = match report.nccl_ready() {
        Ok(n) => n,
        Err(reason) => {
            println!("gpu_nccl: skipped: no CUDA ({reason})");
            return;
        }
    };
    for (lib, path) in &report.found {
        println!("found {lib} at {}", path.display());
    }
    let mut failed = Vec::new();
    if let Some((_, p)) = report.found.iter().find(|(l, _)| *l == CudaLib::Nccl) {
        match so2_only(p) {
            Ok(m) => println!("gpu_nccl: so.2-only probe: {m}"),
            Err(e) => {
                println!("gpu_nccl: so.2-only probe FAILED: {e}");
                failed.push(format!("so.2 probe: {e}"));
            }
        }
    }
    if ndev < 2 {
        println!("gpu_nccl: skipped: no CUDA (needs 2 GPUs, {ndev} visible)");
        return;
    }
    let cases = gpu_cases(48);
    let token = generate_token().expect("token");
    let server =
        StoreServer::bind("127.0.0.1:0".parse().expect("addr"), token.clone()).expect("store");
    let addr = server.local_addr().to_string();
    for world in [2usize, 4] {
        if world > ndev {
            println!(
                "gpu_nccl: world {world}: skipped: no CUDA (needs {world} GPUs, {ndev} visible)"
            );
            continue;
        }
        // The same cases on plain driver memory, then (half as many) on memory from NCCL's
        // allocator, which each comm registers on first use (zero-copy transfers).
        for (scenario, n) in [("cases", cases), ("registered", cases.div_ceil(2))] {
            let what = format!("gpu_nccl: world {world} {scenario}");
            let spawn = || spawn_all(scenario, world, &addr, &token, n);
            if let Some(codes) = ranks_failed(&what, spawn, Duration::from_secs(240)) {
                failed.push(format!("{scenario} world {world}: {codes:?}"));
            }
        }
    }
    let what = "gpu_nccl: dead-peer watchdog";
    let spawn = || spawn_all("dead", 2, &addr, &token, 0);
    if let Some(codes) = ranks_failed(what, spawn, Duration::from_secs(90)) {
        failed.push(format!("dead peer: {codes:?}"));
    }
    drop(server);
    if !failed.is_empty() {
        eprintln!("gpu_nccl: FAILED: {failed:?}");
        std::process::exit(1);
    }
    println!("gpu_nccl: all GPU scenarios passed");
}
