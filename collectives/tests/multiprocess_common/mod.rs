//! Random collective scenarios shared by the backend tests: a seed expands into a sequence of
//! collectives on random sub-groups; every rank runs it and checks its results against a
//! sequential reference computed from the (deterministic) inputs of all ranks.
#![allow(dead_code)]

use oxiflow_collectives::{CommError, Communicator, DType, InProcessWorld, ReduceOp, SharedComm};
use oxiflow_dtype::{bf16, f16};

/// One collective of a scenario; `group` lists world ranks in member order.
#[derive(Clone, Debug)]
pub enum Step {
    AllReduce {
        group: Vec<usize>,
        count: usize,
        op: ReduceOp,
    },
    AllGatherV {
        group: Vec<usize>,
        counts: Vec<usize>,
    },
    ReduceScatterV {
        group: Vec<usize>,
        counts: Vec<usize>,
        op: ReduceOp,
    },
    /// `matrix[i][j]`: elements member i sends to member j; `exchanged`: through
    /// `all_to_all_v_exchanged` (receivers learn their counts from the call).
    AllToAllV {
        group: Vec<usize>,
        matrix: Vec<Vec<usize>>,
        exchanged: bool,
    },
    Broadcast {
        group: Vec<usize>,
        count: usize,
        root: usize,
    },
    Reduce {
        group: Vec<usize>,
        count: usize,
        root: usize,
        op: ReduceOp,
    },
    /// Both members send to each other first, then receive.
    SendRecv {
        group: Vec<usize>,
        count: usize,
    },
    Barrier {
        group: Vec<usize>,
    },
}

#[derive(Clone, Debug)]
pub struct Case {
    pub world: usize,
    pub dtype: DType,
    pub steps: Vec<Step>,
}

/// splitmix64: a tiny deterministic generator so every process expands the same seed alike.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn random_group(rng: &mut Rng, world: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..world).collect();
    for i in (1..world).rev() {
        let j = rng.below(i + 1);
        all.swap(i, j);
    }
    // Half of the steps run on the whole world (in a shuffled order half of those times).
    if rng.below(2) == 0 {
        if rng.below(2) == 0 {
            all.sort_unstable();
        }
        return all;
    }
    let k = 1 + rng.below(world);
    all.truncate(k);
    all
}

fn count(rng: &mut Rng, max: usize) -> usize {
    match rng.below(4) {
        0 => 0,
        1 => rng.below(4),
        _ => rng.below(max + 1),
    }
}

fn op(rng: &mut Rng) -> ReduceOp {
    [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][rng.below(3)]
}

impl Case {
    /// The case a worker process is told to run: `generate` of the variables `OXF_MP_SEED`,
    /// `OXF_MP_DTYPE` (an index of `dtype_of`), `OXF_MP_STEPS` and `OXF_MP_MAX`.
    pub fn from_vars(world: usize) -> Case {
        let var = |name: &str| -> usize {
            let v = std::env::var(name).unwrap_or_default();
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v:?} is no count"))
        };
        let seed = var("OXF_MP_SEED") as u64;
        let (dtype, steps, max) = (var("OXF_MP_DTYPE"), var("OXF_MP_STEPS"), var("OXF_MP_MAX"));
        Case::generate(seed, world, dtype_of(dtype), steps, max)
    }

    /// Expands `seed` into `nsteps` collectives on a world of `world` ranks with counts up to
    /// `max` elements per piece.
    pub fn generate(seed: u64, world: usize, dtype: DType, nsteps: usize, max: usize) -> Case {
        let mut rng = Rng::new(seed);
        let steps = (0..nsteps)
            .map(|s| {
                let group = random_group(&mut rng, world);
                let n = group.len();
                match rng.below(8) {
                    0 => Step::AllReduce {
                        count: count(&mut rng, max),
                        op: op(&mut rng),
                        group,
                    },
                    1 => Step::AllGatherV {
                        counts: (0..n).map(|_| count(&mut rng, max)).collect(),
                        group,
                    },
                    2 => Step::ReduceScatterV {
                        counts: (0..n).map(|_| count(&mut rng, max)).collect(),
                        op: op(&mut rng),
                        group,
                    },
                    3 => Step::AllToAllV {
                        matrix: (0..n)
                            .map(|_| (0..n).map(|_| count(&mut rng, max)).collect())
                            .collect(),
                        exchanged: s % 2 == 1,
                        group,
                    },
                    4 => Step::Broadcast {
                        count: count(&mut rng, max),
                        root: rng.below(n),
                        group,
                    },
                    5 => Step::Reduce {
                        count: count(&mut rng, max),
                        root: rng.below(n),
                        op: op(&mut rng),
                        group,
                    },
                    6 if world >= 2 => {
                        let mut g = group;
                        if g.len() < 2 {
                            g = vec![g[0], (g[0] + 1) % world];
                        }
                        g.truncate(2);
                        Step::SendRecv {
                            group: g,
                            count: count(&mut rng, max),
                        }
                    }
                    _ => Step::Barrier { group },
                }
            })
            .collect();
        Case {
            world,
            dtype,
            steps,
        }
    }
}

/// Input element `i` of world rank `r` at step `s`: small integers, so float sums are exact;
/// for 16-bit floats values of 8 significant bits at scales 1 to 2^-6, whose sums are exact in
/// f32 but not in 16 bits, so only a reduction that rounds once matches the reference.
pub fn val(dt: DType, r: usize, s: usize, i: usize) -> f64 {
    if dt.is_half() {
        let m = ((r * 37 + s * 11 + i * 29) % 255) as f64 - 127.0;
        m / f64::from(1u32 << ((r + 2 * s + i) % 7))
    } else {
        (((r * 7 + s * 13 + i * 3) % 23) as i64 - 11) as f64
    }
}

/// `v` (values `dt` holds exactly) as native-endian elements of `dt`.
pub fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dtype.size());
    for &x in v {
        match dtype {
            DType::F32 => out.extend_from_slice(&(x as f32).to_ne_bytes()),
            DType::F64 => out.extend_from_slice(&x.to_ne_bytes()),
            DType::I64 => out.extend_from_slice(&(x as i64).to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(x).to_ne_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(x).to_ne_bytes()),
        }
    }
    out
}

pub fn decode(dtype: DType, b: &[u8]) -> Vec<f64> {
    b.chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F32 => f64::from(f32::from_ne_bytes(c.try_into().unwrap())),
            DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
            DType::I64 => i64::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::BF16 => bf16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
            DType::F16 => f16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
        })
        .collect()
}

/// `x` rounded once to `dt` (exact for the others: their test values and sums are integers).
fn rounded(dt: DType, x: f64) -> f64 {
    match dt {
        DType::BF16 => bf16::from_f32(x as f32).to_f64(),
        DType::F16 => f16::from_f32(x as f32).to_f64(),
        _ => x,
    }
}

fn combine(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum => a + b,
        ReduceOp::Max => a.max(b),
        ReduceOp::Min => a.min(b),
    }
}

fn inputs(dt: DType, r: usize, s: usize, off: usize, n: usize) -> Vec<f64> {
    (off..off + n).map(|i| val(dt, r, s, i)).collect()
}

/// The reference: the exact (f64, hence f32) reduction in member order, rounded once.
fn reduced(dt: DType, group: &[usize], s: usize, off: usize, n: usize, op: ReduceOp) -> Vec<f64> {
    (off..off + n)
        .map(|i| {
            let exact = group
                .iter()
                .map(|&r| val(dt, r, s, i))
                .reduce(|a, b| combine(op, a, b))
                .unwrap_or(0.0);
            rounded(dt, exact)
        })
        .collect()
}

fn check(what: String, got: Vec<f64>, want: Vec<f64>) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}

/// Runs `f` on every communicator of `comms`, each on a thread of its own (in-process ranks);
/// their results in member order.
pub fn run_threads<T: Send + 'static>(
    comms: Vec<SharedComm>,
    f: impl Fn(SharedComm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Runs `call` on every member of an in-process world of 3 (300 ms timeout) but member 2,
/// which never arrives: every other member fails within 5 s with a timeout naming member 2.
pub fn assert_member_2_missing<T: std::fmt::Debug + Send + 'static>(
    call: impl Fn(&SharedComm) -> Result<T, CommError> + Send + Sync + 'static,
) {
    let comms = InProcessWorld::new(3, std::time::Duration::from_millis(300));
    let start = std::time::Instant::now();
    let out = run_threads(comms, move |c| (c.rank() != 2).then(|| call(&c)));
    assert!(start.elapsed() < std::time::Duration::from_secs(5));
    for r in out.into_iter().flatten() {
        match r {
            Err(CommError::Timeout { missing, .. }) => assert_eq!(missing, vec![2]),
            other => panic!("expected a timeout naming rank 2, got {other:?}"),
        }
    }
}

/// Runs `case` as world rank `comm.rank()`, checking every result; the error names the step.
pub fn run_rank(world: &SharedComm, case: &Case) -> Result<(), String> {
    let me = world.rank();
    let dt = case.dtype;
    for (s, step) in case.steps.iter().enumerate() {
        let group = match step {
            Step::AllReduce { group, .. }
            | Step::AllGatherV { group, .. }
            | Step::ReduceScatterV { group, .. }
            | Step::AllToAllV { group, .. }
            | Step::Broadcast { group, .. }
            | Step::Reduce { group, .. }
            | Step::SendRecv { group, .. }
            | Step::Barrier { group } => group,
        };
        let Some(m) = group.iter().position(|&r| r == me) else {
            continue;
        };
        let comm = world
            .sub_group(group)
            .map_err(|e| format!("step {s}: {e}"))?;
        if comm.rank() != m || comm.world_ranks() != &group[..] {
            return Err(format!(
                "step {s}: sub_group has rank {} ranks {:?}",
                comm.rank(),
                comm.world_ranks()
            ));
        }
        let ctx = |e: oxiflow_collectives::CommError| format!("rank {me} step {s} {step:?}: {e}");
        let what = || format!("rank {me} step {s} {step:?}");
        let expect = |got: &[u8], want: Vec<f64>| check(what(), decode(dt, got), want);
        match step {
            Step::AllReduce { count, op, .. } => {
                let mut b = encode(dt, &inputs(dt, me, s, 0, *count));
                comm.all_reduce(dt, (&mut b[..]).into(), *op).map_err(ctx)?;
                expect(&b, reduced(dt, group, s, 0, *count, *op))?;
            }
            Step::AllGatherV { counts, .. } => {
                let send = encode(dt, &inputs(dt, me, s, 0, counts[m]));
                let mut recv = vec![0u8; counts.iter().sum::<usize>() * dt.size()];
                comm.all_gather_v(dt, (&send[..]).into(), (&mut recv[..]).into(), counts)
                    .map_err(ctx)?;
                let want: Vec<f64> = group
                    .iter()
                    .zip(counts)
                    .flat_map(|(&r, &c)| inputs(dt, r, s, 0, c))
                    .collect();
                expect(&recv, want)?;
            }
            Step::ReduceScatterV { counts, op, .. } => {
                let total: usize = counts.iter().sum();
                let send = encode(dt, &inputs(dt, me, s, 0, total));
                let mut recv = vec![0u8; counts[m] * dt.size()];
                comm.reduce_scatter_v(dt, (&send[..]).into(), (&mut recv[..]).into(), counts, *op)
                    .map_err(ctx)?;
                let off: usize = counts[..m].iter().sum();
                expect(&recv, reduced(dt, group, s, off, counts[m], *op))?;
            }
            Step::AllToAllV {
                matrix, exchanged, ..
            } => {
                let n = group.len();
                let sc: Vec<usize> = matrix[m].clone();
                let rc: Vec<usize> = (0..n).map(|i| matrix[i][m]).collect();
                // Member i sends to j the elements at offset 1000*j of its input stream.
                let send_v: Vec<f64> = (0..n)
                    .flat_map(|j| inputs(dt, me, s, 1000 * j, sc[j]))
                    .collect();
                let send = encode(dt, &send_v);
                let recv = if *exchanged {
                    let (recv, counts) =
                        comm.all_to_all_v_exchanged(dt, &send, &sc).map_err(ctx)?;
                    if counts != rc {
                        return Err(format!("{}: received counts {counts:?}", what()));
                    }
                    recv
                } else {
                    let mut recv = vec![0u8; rc.iter().sum::<usize>() * dt.size()];
                    comm.all_to_all_v(dt, (&send[..]).into(), &sc, (&mut recv[..]).into(), &rc)
                        .map_err(ctx)?;
                    recv
                };
                let want: Vec<f64> = (0..n)
                    .flat_map(|i| inputs(dt, group[i], s, 1000 * m, rc[i]))
                    .collect();
                expect(&recv, want)?;
            }
            Step::Broadcast { count, root, .. } => {
                let mut b = encode(dt, &inputs(dt, me, s, 0, *count));
                comm.broadcast(dt, (&mut b[..]).into(), *root)
                    .map_err(ctx)?;
                expect(&b, inputs(dt, group[*root], s, 0, *count))?;
            }
            Step::Reduce {
                count, root, op, ..
            } => {
                let mut b = encode(dt, &inputs(dt, me, s, 0, *count));
                comm.reduce(dt, (&mut b[..]).into(), *root, *op)
                    .map_err(ctx)?;
                if m == *root {
                    expect(&b, reduced(dt, group, s, 0, *count, *op))?;
                }
            }
            Step::SendRecv { count, .. } => {
                let peer = 1 - m;
                let send = encode(dt, &inputs(dt, me, s, 0, *count));
                comm.send(dt, (&send[..]).into(), peer).map_err(ctx)?;
                let mut recv = vec![0u8; count * dt.size()];
                comm.recv(dt, (&mut recv[..]).into(), peer).map_err(ctx)?;
                expect(&recv, inputs(dt, group[peer], s, 0, *count))?;
            }
            Step::Barrier { .. } => comm.barrier().map_err(ctx)?,
        }
    }
    Ok(())
}

/// The dtypes the scenarios run on (`dtype_of(i)` for `i in 0..DTYPES`).
pub const DTYPES: usize = 5;

pub fn dtype_of(i: usize) -> DType {
    [DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16][i % DTYPES]
}

/// Silences "unused" in test crates that only need part of this module.
pub fn _uses(_: &dyn Communicator) {}
