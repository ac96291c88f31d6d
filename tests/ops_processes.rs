//! Global ops on real processes: the test binary re-runs itself as 4 `oflaunch` workers (CPU
//! backend, shared memory between ranks), each running the same seeded random op chains on
//! global tensors over several placements (1-d, 2-d, subsets of the world, scrambled orders) and
//! input nd-SBPs (incl. P), and comparing the gathered result with the same chain on local
//! tensors (the single-rank computation). The in-process proptests cover far more cases; this
//! is the sample that crosses process boundaries.

mod common;

use common::argv;

use std::process::Command;

use oxiflow::prelude::*;

const WORKER_VAR: &str = "OXIFLOW_TEST_OPS_WORKER";
const CHAINS: u64 = 40;

/// SplitMix64: a tiny deterministic generator, identical on every rank.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn placements() -> Vec<Placement> {
    [
        "cpu:[0, 1, 2, 3]",
        "cpu:[2, 0, 3]",
        "cpu:[1, 3]",
        "cpu:[[0, 1], [2, 3]]",
        "cpu:[[3, 1], [0, 2]]",
        "cpu:[[0], [1], [2], [3]]",
    ]
    .iter()
    .map(|t| t.parse().expect("placement"))
    .collect()
}

fn random_nd_sbp(rng: &mut Rng, ndim: usize, mesh_axes: usize) -> NdSbp {
    NdSbp::new((0..mesh_axes).map(|_| match rng.below(ndim + 2) {
        k if k < ndim => Sbp::S(k),
        k if k == ndim => Sbp::B,
        _ => Sbp::P,
    }))
}

/// One input: the global tensor and the same value as a local tensor.
fn input(rng: &mut Rng, shape: &[usize], p: &Placement) -> oxiflow::Result<(Tensor, Tensor)> {
    let seed = rng.next();
    let sbp = random_nd_sbp(rng, shape.len(), p.ndim());
    let g = Tensor::randn_global(shape.to_vec(), seed, DType::F32, p, sbp)?;
    Ok((g, Tensor::randn(shape.to_vec(), seed, DType::F32)))
}

/// Runs one chain on (global, local) pairs; returns (global result, local result, description).
fn chain(seed: u64, p: &Placement) -> oxiflow::Result<(Tensor, Tensor, String)> {
    let mut rng = Rng(seed);
    let mut shape: Vec<usize> = (0..2 + rng.below(2)).map(|_| 1 + rng.below(6)).collect();
    let (mut g, mut l) = input(&mut rng, &shape, p)?;
    let mut what = format!(
        "{} on {p} as {}",
        g.shape(),
        g.nd_sbp().map(|s| s.to_string()).unwrap_or_default()
    );
    for _ in 0..1 + rng.below(5) {
        let nd = shape.len();
        let (ng, nl, name) = match rng.below(9) {
            0 => (g.relu()?, l.relu()?, "relu".to_string()),
            1 => (g.tanh()?, l.tanh()?, "tanh".to_string()),
            2 | 3 => {
                let (og, ol) = input(&mut rng, &shape, p)?;
                if rng.below(2) == 0 {
                    (
                        g.add(&og)?,
                        l.add(&ol)?,
                        format!(
                            "add {}",
                            og.nd_sbp().map(|s| s.to_string()).unwrap_or_default()
                        ),
                    )
                } else {
                    (
                        g.mul(&og)?,
                        l.mul(&ol)?,
                        format!(
                            "mul {}",
                            og.nd_sbp().map(|s| s.to_string()).unwrap_or_default()
                        ),
                    )
                }
            }
            4 if nd == 2 => {
                let n = 1 + rng.below(5);
                let (wg, wl) = input(&mut rng, &[shape[1], n], p)?;
                shape = vec![shape[0], n];
                (
                    g.matmul(&wg)?,
                    l.matmul(&wl)?,
                    format!(
                        "matmul {}",
                        wg.nd_sbp().map(|s| s.to_string()).unwrap_or_default()
                    ),
                )
            }
            5 if nd >= 2 => {
                let d = rng.below(nd);
                shape.remove(d);
                (
                    g.sum(&[d as isize], false)?,
                    l.sum(&[d as isize], false)?,
                    format!("sum dim {d}"),
                )
            }
            6 => {
                let d = rng.below(nd) as isize;
                (g.softmax(d)?, l.softmax(d)?, format!("softmax dim {d}"))
            }
            7 => {
                shape.swap(0, nd - 1);
                (
                    g.transpose(0, nd as isize - 1)?,
                    l.transpose(0, nd as isize - 1)?,
                    "transpose".to_string(),
                )
            }
            _ => {
                let sbp = random_nd_sbp(&mut rng, nd, p.ndim());
                let name = format!("to_global {sbp}");
                (g.to_global(p, sbp)?, l.clone(), name)
            }
        };
        g = ng;
        l = nl;
        what.push_str(" -> ");
        what.push_str(&name);
    }
    Ok((g, l, what))
}

fn worker() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = oxiflow::init_from_env()?;
    let rank = ctx.rank();
    let ps = placements();
    let mut checked = 0;
    for seed in 0..CHAINS {
        let p = &ps[seed as usize % ps.len()];
        let (g, l, what) = chain(seed, p)?;
        if !p.contains(rank) {
            continue;
        }
        let got = g.to_ndarray::<f32>()?;
        let want = l.to_ndarray::<f32>()?;
        if got.shape() != want.shape() {
            return Err(format!(
                "chain {seed} ({what}): shape {:?} vs {:?}",
                got.shape(),
                want.shape()
            )
            .into());
        }
        for (a, b) in got.iter().zip(want.iter()) {
            if (a - b).abs() > 1e-4 * (1.0 + b.abs()) {
                return Err(format!("chain {seed} ({what}): {a} vs single-rank {b}").into());
            }
        }
        checked += 1;
    }
    println!("rank {rank}: {checked} chains equal the single-rank results");
    Ok(())
}

/// Worker mode: runs only under oflaunch with the marker variable set; a plain test run skips it.
#[test]
fn ops_worker_entry() {
    if std::env::var_os(WORKER_VAR).is_none() {
        return;
    }
    if let Err(e) = worker() {
        eprintln!("ops worker failed: {e}");
        std::process::exit(1);
    }
}

#[test]
fn random_op_chains_on_real_processes_equal_single_rank_results() {
    let (oflaunch, _) = common::binaries();
    let me = std::env::current_exe().expect("test binary path");
    let out = Command::new(oflaunch)
        .args(argv("--nproc-per-node 4 --backend cpu --timeout 60"))
        .arg(&me)
        .args(argv(
            "--exact ops_worker_entry --nocapture --test-threads 1",
        ))
        .env(WORKER_VAR, "1")
        .output()
        .expect("run oflaunch");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "workers failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    for rank in 0..4 {
        let tag = format!("[rank {rank}]");
        let mine = format!("rank {rank}: ");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&tag) && l.contains(&mine) && l.contains("chains equal")),
            "rank {rank} did not report:\n{stdout}"
        );
    }
    eprintln!(
        "{}",
        stdout
            .lines()
            .filter(|l| l.contains("chains equal"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
