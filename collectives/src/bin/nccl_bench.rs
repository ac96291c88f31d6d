//! Benchmark of the boxing collectives on GPUs: S->B (all-gather), P->B (all-reduce), P->S
//! (reduce-scatter) and S(0)->S(1) (NVRTC pack kernel + all-to-all) of f32 tensors, through
//! `NcclComm`'s `Communicator` calls next to a tight loop of the bare NCCL call, busbw by the
//! nccl-tests rules. One process per GPU, meeting through the rendezvous store. For S(0)->S(1)
//! also: the bare loop on `ncclMemAlloc` buffers registered with the comm (`nccl-registered`),
//! and the pack of each call overlapping the previous all-to-all on registered or plain buffer
//! pairs (`pack+registered`, `pack+plain`).
//!
//! `nccl_bench --world 4 --sizes-mib 1,4,16,64,256,1024 --out results.json`

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use oxiflow_collectives::cuda_libs::{self, LibSearch};
use oxiflow_collectives::nccl::ffi::{nccl_dtype, nccl_op};
use oxiflow_collectives::nccl::{Completion, DeviceBytes, NcclComm, NcclOptions};
use oxiflow_collectives::rendezvous::{generate_token, StoreClient, StoreServer};
use oxiflow_collectives::{Buf, BufMut, Communicator, DType, DeviceFence, DevicePtr, ReduceOp};

const KERNELS: &str = r#"
extern "C" __global__ void fill(float* out, unsigned long long n, unsigned int seed) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        unsigned int h = (unsigned int)(i * 2654435761ull) ^ seed;
        out[i] = (float)(h % 1000u) * 0.001f;
    }
}
// in: [rp, cols] row-major; out: [p][rp][cp] with cp = cols / p (block j = column block j).
extern "C" __global__ void pack_cols(const float4* in, float4* out, unsigned long long rp,
                                     unsigned long long cols4, unsigned long long cp4) {
    unsigned long long total = rp * cols4;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (; i < total; i += stride) {
        unsigned long long r = i / cols4, c = i % cols4;
        unsigned long long j = c / cp4, cc = c % cp4;
        out[(j * rp + r) * cp4 + cc] = in[i];
    }
}
"#;

struct Kernels {
    fill: CudaFunction,
    pack: CudaFunction,
}

fn grid(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 132 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn fill(k: &Kernels, s: &Arc<CudaStream>, b: &DeviceBytes, seed: u32) {
    let n = (b.len() / 4) as u64;
    let p = b.ptr();
    // SAFETY: fill writes n floats of b.
    unsafe {
        s.launch_builder(&k.fill)
            .arg(&p)
            .arg(&n)
            .arg(&seed)
            .launch(grid(n))
    }
    .expect("fill launch");
}

fn pack(
    k: &Kernels,
    s: &Arc<CudaStream>,
    src: &DeviceBytes,
    dst: &DeviceBytes,
    rp: u64,
    cols: u64,
    p: u64,
) {
    pack_ptrs(k, s, src.ptr(), dst.ptr(), rp, cols, p);
}

/// The end event of the last collective on a buffer pair (the pack waits for it).
#[derive(Default)]
struct LastEvent(std::sync::Mutex<Option<Arc<cudarc::driver::CudaEvent>>>);

impl DeviceFence for LastEvent {
    fn after_collective(&self, done: &Arc<cudarc::driver::CudaEvent>) {
        *self.0.lock().unwrap() = Some(done.clone());
    }
}

/// `pack` between raw device pointers.
fn pack_ptrs(k: &Kernels, s: &Arc<CudaStream>, a: u64, b: u64, rp: u64, cols: u64, p: u64) {
    let cols4 = cols / 4;
    let cp4 = cols / p / 4;
    // SAFETY: both buffers hold rp*cols floats; cols divisible by 4p.
    unsafe {
        s.launch_builder(&k.pack)
            .arg(&a)
            .arg(&b)
            .arg(&rp)
            .arg(&cols4)
            .arg(&cp4)
            .launch(grid(rp * cols4))
    }
    .expect("pack launch");
}

/// Median over `trials` of the mean time (ms) per call of `f`, timed with events on `stream`.
fn time(
    stream: &Arc<CudaStream>,
    iters: usize,
    trials: usize,
    sync: &dyn Fn(),
    f: &mut dyn FnMut(),
) -> f64 {
    for _ in 0..3 {
        f();
    }
    sync();
    let mut v = Vec::new();
    for _ in 0..trials {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = stream.record_event(flags).expect("event");
        for _ in 0..iters {
            f();
        }
        let b = stream.record_event(flags).expect("event");
        sync();
        b.synchronize().expect("sync");
        v.push(a.elapsed_ms(&b).expect("elapsed") as f64 / iters as f64);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn child(rank: usize, world: usize, addr: &str, token: &str, sizes: &[usize]) {
    let store =
        Arc::new(StoreClient::connect(addr, token, Duration::from_secs(30)).expect("store"));
    let opts = NcclOptions {
        job: format!("bench-w{world}"),
        timeout: Duration::from_secs(120),
        completion: Completion::Async,
        ..NcclOptions::default()
    };
    let comm = NcclComm::init_with(store, rank, world, rank, &opts).expect("nccl init");
    cuda_libs::ensure_nvrtc(&LibSearch::default()).expect("nvrtc");
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("nvrtc compile");
    let module = comm.context().load_module(ptx).expect("module");
    let k = Kernels {
        fill: module.load_function("fill").expect("fill"),
        pack: module.load_function("pack_cols").expect("pack"),
    };
    let cs = comm.compute_stream();
    let ms = comm.comm_stream().clone();
    let p = world;
    let sync = || comm.synchronize().expect("comm sync");
    // SAFETY: the bare loops run on this thread only, between our own calls.
    let (nc, raw, rs) = unsafe { comm.raw_handle() };
    let f32t = nccl_dtype(DType::F32);
    let out = |op: &str, imp: &str, bytes: usize, ms_: f64, factor: f64| {
        if rank == 0 {
            let algbw = bytes as f64 / (ms_ * 1e-3) / 1e9;
            println!(
                "RESULT {{\"world\":{world},\"op\":\"{op}\",\"impl\":\"{imp}\",\"bytes\":{bytes},\"ms\":{ms_:.5},\"busbw\":{:.2}}}",
                algbw * factor
            );
        }
    };
    let pf = (p - 1) as f64 / p as f64;
    for &mib in sizes {
        let bytes = mib << 20;
        let n = bytes / 4;
        let nl = n / p;
        let iters = ((4usize << 30) / bytes).clamp(10, 200);
        let trials = 3;
        // S -> B: all-gather of the local piece into the whole tensor.
        {
            let send = DeviceBytes::zeros(&cs, nl * 4).expect("alloc");
            let mut recv = DeviceBytes::zeros(&cs, bytes).expect("alloc");
            fill(&k, &cs, &send, rank as u32);
            let (sp, rp) = (send.ptr(), recv.ptr());
            let t = time(&cs, iters, trials, &sync, &mut || {
                comm.all_gather(DType::F32, send.as_buf(), recv.as_buf_mut())
                    .expect("all_gather")
            });
            out("S->B all-gather", "oxiflow", bytes, t, pf);
            // SAFETY: the raw communicator and stream outlive the loop; sp/rp are live device
            // buffers of nl and p * nl f32 elements.
            let t = time(&ms, iters, trials, &sync, &mut || unsafe {
                (nc.all_gather)(sp as _, rp as _, nl, f32t, raw, rs);
            });
            out("S->B all-gather", "nccl", bytes, t, pf);
        }
        // P -> B: all-reduce.
        {
            let mut buf = DeviceBytes::zeros(&cs, bytes).expect("alloc");
            fill(&k, &cs, &buf, rank as u32);
            let bp = buf.ptr();
            let t = time(&cs, iters, trials, &sync, &mut || {
                comm.all_reduce(DType::F32, buf.as_buf_mut(), ReduceOp::Sum)
                    .expect("all_reduce")
            });
            out("P->B all-reduce", "oxiflow", bytes, t, 2.0 * pf);
            // SAFETY: in-place all-reduce of the n f32 elements of a live device buffer.
            let t = time(&ms, iters, trials, &sync, &mut || unsafe {
                (nc.all_reduce)(bp as _, bp as _, n, f32t, nccl_op(ReduceOp::Sum), raw, rs);
            });
            out("P->B all-reduce", "nccl", bytes, t, 2.0 * pf);
        }
        // P -> S(0): reduce-scatter.
        {
            let send = DeviceBytes::zeros(&cs, bytes).expect("alloc");
            let mut recv = DeviceBytes::zeros(&cs, nl * 4).expect("alloc");
            fill(&k, &cs, &send, rank as u32);
            let (sp, rp) = (send.ptr(), recv.ptr());
            let t = time(&cs, iters, trials, &sync, &mut || {
                comm.reduce_scatter(DType::F32, send.as_buf(), recv.as_buf_mut(), ReduceOp::Sum)
                    .expect("reduce_scatter")
            });
            out("P->S reduce-scatter", "oxiflow", bytes, t, pf);
            // SAFETY: sp holds p * nl and rp nl f32 elements of live device memory.
            let t = time(&ms, iters, trials, &sync, &mut || unsafe {
                (nc.reduce_scatter)(sp as _, rp as _, nl, f32t, nccl_op(ReduceOp::Sum), raw, rs);
            });
            out("P->S reduce-scatter", "nccl", bytes, t, pf);
        }
        // S(0) -> S(1): pack column blocks, all-to-all. Logical [rows, cols].
        {
            let cols = 1024usize;
            let rows = n / cols;
            let rp = rows / p;
            let local = DeviceBytes::zeros(&cs, nl * 4).expect("alloc");
            let packed = DeviceBytes::zeros(&cs, nl * 4).expect("alloc");
            let mut recv = DeviceBytes::zeros(&cs, nl * 4).expect("alloc");
            fill(&k, &cs, &local, rank as u32 * 7 + 1);
            let counts = vec![nl / p; p];
            let t = time(&cs, iters, trials, &sync, &mut || {
                pack(&k, &cs, &local, &packed, rp as u64, cols as u64, p as u64);
                all_to_all_even(&comm, packed.as_buf(), recv.as_buf_mut(), &counts)
            });
            out("S(0)->S(1) all-to-all", "oxiflow", nl * 4, t, pf);
            let c = nl / p;
            let bare_a2a = |name: &str, sp: u64, rcp: u64| {
                // SAFETY: every send/recv covers c elements inside the p * c element buffers
                // at sp and rcp, which outlive the loop; the group brackets them.
                let t = time(&ms, iters, trials, &sync, &mut || unsafe {
                    (nc.group_start)();
                    for j in 0..p {
                        (nc.send)((sp + (j * c * 4) as u64) as _, c, f32t, j as i32, raw, rs);
                        (nc.recv)((rcp + (j * c * 4) as u64) as _, c, f32t, j as i32, raw, rs);
                    }
                    (nc.group_end)();
                });
                out("S(0)->S(1) all-to-all", name, nl * 4, t, pf);
            };
            bare_a2a("nccl", packed.ptr(), recv.ptr());
            // Buffers from NCCL's allocator: one Communicator call registers them with the
            // comm (by address), then the same bare loop runs on them.
            let reg: Vec<DeviceBytes> = (0..4)
                .map(|_| DeviceBytes::zeros_nccl(&cs, nl * 4).expect("ncclMemAlloc"))
                .collect();
            let plain: Vec<DeviceBytes> = (0..4)
                .map(|_| DeviceBytes::zeros(&cs, nl * 4).expect("alloc"))
                .collect();
            let a2a = |s_: u64, r_: u64, f: Option<&LastEvent>| {
                let dev = comm.device();
                // SAFETY: both are live device buffers of nl * 4 bytes.
                let (mut sb, mut rb) = unsafe {
                    (
                        DevicePtr::new(s_, nl * 4, dev),
                        DevicePtr::new(r_, nl * 4, dev),
                    )
                };
                if let Some(f) = f {
                    (sb, rb) = (sb.with_fence(f), rb.with_fence(f));
                }
                all_to_all_even(&comm, Buf::Device(sb), BufMut::Device(rb), &counts)
            };
            a2a(reg[0].ptr(), reg[1].ptr(), None);
            a2a(reg[2].ptr(), reg[3].ptr(), None);
            bare_a2a("nccl-registered", reg[0].ptr(), reg[1].ptr());
            // The pack of each call overlapping the previous all-to-all, on two buffer pairs
            // (as the tensor pool rotates blocks): registered, then plain.
            for (name, b) in [("pack+registered", &reg), ("pack+plain", &plain)] {
                let bufs = [(b[0].ptr(), b[1].ptr()), (b[2].ptr(), b[3].ptr())];
                let fences = [LastEvent::default(), LastEvent::default()];
                let mut flip = 0usize;
                let t = time(&cs, iters, trials, &sync, &mut || {
                    flip ^= 1;
                    let (s_, r_) = bufs[flip];
                    let f = &fences[flip];
                    if let Some(e) = f.0.lock().unwrap().take() {
                        cs.wait(&e).expect("wait fence");
                    }
                    pack_ptrs(&k, &cs, local.ptr(), s_, rp as u64, cols as u64, p as u64);
                    a2a(s_, r_, Some(f))
                });
                out("S(0)->S(1) all-to-all", name, nl * 4, t, pf);
                sync();
            }
            if mib == sizes[0] {
                check_s0_s1(&comm, &k, &cs, rank, p, cols, rows);
            }
        }
    }
    comm.barrier().expect("barrier");
}

/// An f32 all-to-all that sends and receives `counts` (the same list on both sides).
fn all_to_all_even(comm: &NcclComm, send: Buf<'_>, recv: BufMut<'_>, counts: &[usize]) {
    comm.all_to_all_v(DType::F32, send, counts, recv, counts)
        .expect("all_to_all_v")
}

/// Checks the S(0)->S(1) result once against the host rearrangement of the same data.
fn check_s0_s1(
    comm: &NcclComm,
    k: &Kernels,
    cs: &Arc<CudaStream>,
    rank: usize,
    p: usize,
    cols: usize,
    rows: usize,
) {
    let rp = rows / p;
    let cp = cols / p;
    let nl = rp * cols;
    let host = |q: usize| -> Vec<f32> { (0..nl).map(|i| (q * 1_000_003 + i) as f32).collect() };
    let local = DeviceBytes::from_host(cs, bytemuck_f32(&host(rank))).expect("upload");
    let packed = DeviceBytes::zeros(cs, nl * 4).expect("alloc");
    let mut recv = DeviceBytes::from_host(cs, &vec![0xffu8; nl * 4]).expect("alloc");
    pack(k, cs, &local, &packed, rp as u64, cols as u64, p as u64);
    let counts = vec![nl / p; p];
    all_to_all_even(comm, packed.as_buf(), recv.as_buf_mut(), &counts);
    comm.synchronize().expect("sync");
    let got = recv.to_host().expect("download");
    let mut expect = Vec::with_capacity(nl);
    for q in 0..p {
        let h = host(q);
        for r in 0..rp {
            expect.extend_from_slice(&h[r * cols + rank * cp..r * cols + (rank + 1) * cp]);
        }
    }
    assert_eq!(
        got,
        bytemuck_f32(&expect),
        "S(0)->S(1) result differs from the host rearrangement"
    );
    if rank == 0 {
        println!("CHECK S(0)->S(1) [{rows}x{cols}] on {p} ranks equals the host rearrangement");
    }
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; u8 alignment is 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() >= 7 && args[1] == "child" {
        let sizes: Vec<usize> = args[6].split(',').filter_map(|s| s.parse().ok()).collect();
        child(
            args[2].parse().expect("rank"),
            args[3].parse().expect("world"),
            &args[4],
            &args[5],
            &sizes,
        );
        return;
    }
    let report = cuda_libs::probe(&LibSearch::default());
    let ndev = match report.nccl_ready() {
        Ok(n) => n,
        Err(reason) => {
            println!("nccl_bench: skipped: no CUDA ({reason})");
            return;
        }
    };
    let world: usize = arg(&args, "--world")
        .and_then(|s| s.parse().ok())
        .unwrap_or(ndev);
    if world > ndev || world < 2 {
        println!("nccl_bench: skipped: no CUDA (needs {world} >= 2 GPUs, {ndev} visible)");
        return;
    }
    let sizes = arg(&args, "--sizes-mib")
        .unwrap_or("1,4,16,64,256,1024")
        .to_string();
    let token = generate_token().expect("token");
    let server =
        StoreServer::bind("127.0.0.1:0".parse().expect("addr"), token.clone()).expect("store");
    let addr = server.local_addr().to_string();
    let exe = std::env::current_exe().expect("exe");
    let mut kids: Vec<_> = (0..world)
        .map(|r| {
            Command::new(&exe)
                .args([
                    "child",
                    &r.to_string(),
                    &world.to_string(),
                    &addr,
                    &token,
                    &sizes,
                ])
                .env("NCCL_NVLS_ENABLE", "0")
                .stdout(if r == 0 {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .spawn()
                .expect("spawn")
        })
        .collect();
    let mut results = Vec::new();
    if let Some(out) = kids[0].stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("{line}");
            if let Some(j) = line.strip_prefix("RESULT ") {
                results.push(j.to_string());
            }
        }
    }
    let mut ok = true;
    for (r, k) in kids.iter_mut().enumerate() {
        let s = k.wait().expect("wait");
        if !s.success() {
            eprintln!("nccl_bench: rank {r} exited with {s}");
            ok = false;
        }
    }
    if let Some(path) = arg(&args, "--out") {
        let mut f = std::fs::File::create(path).expect("out file");
        writeln!(f, "[{}]", results.join(",\n")).expect("write");
    }
    drop(server);
    if !ok {
        std::process::exit(1);
    }
}
