//! Shared helpers of the ops tests: the one-rank CUDA world, placements, meshes and nd-SBPs
//! drawn from seeds, values read as f64 and compared within a tolerance, per rank.

#![allow(dead_code)]

use std::time::Duration;

use oxiflow_collectives::env::{BackendChoice, LaunchEnv};
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};
use oxiflow_cuda::{cuda_unavailable, init_with_env};
use oxiflow_placement::Placement;
use oxiflow_tensor::{run_ranks, Context, DType, DeviceType, NdSbp, Sbp, Tensor};
use proptest::prelude::*;

/// This process as rank 0 of a one-rank NCCL world bound to cuda:0, through a rendezvous store
/// of its own (kept alive by the returned server), installed as the default context: how a
/// rank runs under `oflaunch --backend nccl`, so device pieces box as on a GPU job.
pub fn cuda_world() -> Result<(Context, StoreServer), String> {
    let token = generate_token().map_err(|e| e.to_string())?;
    let server = StoreServer::bind("127.0.0.1:0".parse().expect("an address"), token.clone())
        .map_err(|e| e.to_string())?;
    let addr = server.local_addr();
    let mut env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    env.rank = 0;
    env.world_size = 1;
    env.local_rank = 0;
    env.local_world_size = 1;
    env.master_addr = addr.ip().to_string();
    env.master_port = addr.port();
    env.token = Some(token);
    env.backend = BackendChoice::Nccl;
    let ctx = init_with_env(&env).map_err(|e| e.to_string())?;
    Ok((ctx, server))
}

/// The world of [`cuda_world`], or None (having printed that test `name` was skipped) where
/// there is no CUDA device.
pub fn cuda_world_or_skip(name: &str) -> Option<(Context, StoreServer)> {
    if let Some(why) = cuda_unavailable() {
        eprintln!("{name}: skipped: no CUDA ({why})");
        return None;
    }
    Some(cuda_world().expect("a one-rank NCCL world on cuda:0"))
}

/// The world of [`cuda_world`] and the one-rank placement on its device, cuda:0, or None
/// (having printed that test `name` was skipped) where there is no CUDA device.
pub fn cuda_device_or_skip(name: &str) -> Option<((Context, StoreServer), Placement)> {
    let world = cuda_world_or_skip(name)?;
    Some((world, Placement::new_1d(DeviceType::Cuda, vec![0]).unwrap()))
}

/// A placement over mesh `mesh` with its ranks permuted by `perm`.
pub fn placement(mesh: &[usize], perm: u64) -> Placement {
    let n: usize = mesh.iter().product();
    let mut ranks: Vec<usize> = (0..n).collect();
    for (i, s) in (1..n).rev().zip(lcg(perm)) {
        ranks.swap(i, (s >> 33) as usize % (i + 1));
    }
    Placement::new(DeviceType::Cpu, mesh.to_vec(), ranks).unwrap()
}

/// One SBP per mesh axis from `seed`: S(0..ndim), B, or (with `allow_p`) P.
pub fn nd_sbp(naxes: usize, ndim: usize, seed: u64, allow_p: bool) -> NdSbp {
    NdSbp::new(lcg(seed).take(naxes).map(|s| {
        match (s >> 33) as usize % (ndim + 1 + usize::from(allow_p)) {
            d if d < ndim => Sbp::S(d),
            d if d == ndim => Sbp::B,
            _ => Sbp::P,
        }
    }))
}

/// One SBP per mesh axis from `seed`, each one of `choices`.
pub fn nd_sbp_of(naxes: usize, seed: u64, choices: &[Sbp]) -> NdSbp {
    NdSbp::new(
        lcg(seed)
            .take(naxes)
            .map(|s| choices[(s >> 33) as usize % choices.len()]),
    )
}

/// 1-d meshes of 1 to 5 ranks and a few 2-d ones.
pub fn mesh_strategy() -> impl Strategy<Value = Vec<usize>> {
    meshes(5, vec![vec![2, 2], vec![2, 3], vec![3, 2], vec![1, 3]])
}

/// 1-d meshes of 1 to `ranks` ranks and the 2-d meshes `grids`, as often each.
pub fn meshes(ranks: usize, grids: Vec<Vec<usize>>) -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        (1usize..=ranks).prop_map(|n| vec![n]),
        prop::sample::select(grids),
    ]
}

/// Where a global case runs: a mesh drawn from `mesh`, the seed that permutes its ranks (see
/// `placement`), and whether one rank outside the placement runs beside it (one case in five).
pub fn layouts(
    mesh: impl Strategy<Value = Vec<usize>>,
) -> impl Strategy<Value = (Vec<usize>, u64, bool)> {
    (mesh, any::<u64>(), prop::bool::weighted(0.2))
}

/// The global property test of a decoding op's file, `any_layout_equals_one_rank`: on 1-d
/// meshes of 1 to 4 ranks and the 2x2 and 2x1 grids (see `layouts`), with the file's `dims()`
/// and two seeds, the file's `global_case(placement, extra, dims, seed, layout_seed)` holds.
#[allow(unused_macros)]
macro_rules! decode_layouts_equal_one_rank {
    () => {
        proptest! {
            #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 16, ..ProptestConfig::default() })]
            #[test]
            fn any_layout_equals_one_rank(
                (mesh, perm, extra) in crate::common::layouts(
                    crate::common::meshes(4, vec![vec![2, 2], vec![2, 1]]),
                ),
                d in dims(),
                seed in any::<u64>(),
                lseed in any::<u64>(),
            ) {
                global_case(&crate::common::placement(&mesh, perm), extra, d, seed, lseed);
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use decode_layouts_equal_one_rank;

/// The global property test of an element-wise op's file, `any_layout_equals_one_rank`: in 48
/// cases on the meshes of `mesh_strategy` (see `layouts`) and the arguments drawn from the
/// given strategies, the file's `global_case(mesh, perm, extra, arguments..)` holds.
#[allow(unused_macros)]
macro_rules! pointwise_layouts_equal_one_rank {
    ($($arg:ident in $strategy:expr),* $(,)?) => {
        proptest! {
            #![proptest_config(ProptestConfig { cases: 48, max_shrink_iters: 32, ..ProptestConfig::default() })]
            #[test]
            fn any_layout_equals_one_rank(
                (mesh, perm, extra) in crate::common::layouts(crate::common::mesh_strategy()),
                $($arg in $strategy,)*
            ) {
                global_case(&mesh, perm, extra, $($arg),*);
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use pointwise_layouts_equal_one_rank;

/// Asserts that the error `e` is a `TensorError::$kind` raised by op `$op`, with the error's
/// message as the failure's.
#[allow(unused_macros)]
macro_rules! assert_op_error {
    ($e:expr, $kind:ident, $op:literal) => {{
        let e = &$e;
        assert!(
            matches!(e, oxiflow_tensor::TensorError::$kind { op: $op, .. }),
            "{e}"
        );
    }};
}
#[allow(unused_imports)]
pub(crate) use assert_op_error;

/// The values of `t` (any float dtype; global: this rank's view of the whole) as f64.
pub fn vals(t: &Tensor) -> Vec<f64> {
    t.cast(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// The bits of `t`'s values, each widened to f64 (exact for every float dtype).
pub fn bits(t: &Tensor) -> Vec<u64> {
    vals(t).iter().map(|v| v.to_bits()).collect()
}

/// Asserts `got` is within `rel` (relative, with an absolute floor of `rel`) of `want`.
pub fn close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rel * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: {g} vs {w} (tolerance {tol})"
        );
    }
}

/// Asserts every rank's values (None: a rank outside the placement) equal the one-rank
/// values `want` within 1e-12, each named by `names` in the message beside `what`.
pub fn assert_ranks_equal<const N: usize>(
    results: Vec<Option<[Vec<f64>; N]>>,
    want: &[Vec<f64>; N],
    names: [&str; N],
    what: &str,
) {
    for (rank, got) in results.into_iter().enumerate() {
        let Some(got) = got else { continue };
        for ((g, w), name) in got.iter().zip(want).zip(names) {
            close(g, w, 1e-12, &format!("rank {rank} {name}, {what}"));
        }
    }
}

/// The forward value and both input gradients of `sum(op(a, b) * r)`, read where `read` (a
/// rank outside the placement runs the ops but holds no values).
fn weighted_outcome(
    op: impl Fn(&Tensor, &Tensor) -> Tensor,
    [a, b, r]: [Tensor; 3],
    read: bool,
) -> Option<[Vec<f64>; 3]> {
    let (a, b) = (
        a.detach().requires_grad_(true),
        b.detach().requires_grad_(true),
    );
    let y = op(&a, &b);
    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    read.then(|| [vals(&y), vals(&a.grad().unwrap()), vals(&b.grad().unwrap())])
}

/// Asserts the global property of a two-input op: on `p` (and one rank outside it with
/// `extra`), its inputs `make(0)`, `make(1)` and the loss weight `make(2)` (whole values on
/// every rank, boxed from broadcast to `nds`) give the value and input gradients of
/// `sum(op(a, b) * r)` that one rank gives, each named by `names` beside `what`.
pub fn assert_layouts_equal_one_rank(
    p: &Placement,
    extra: bool,
    nds: &[NdSbp; 3],
    make: impl Fn(usize) -> Tensor + Sync,
    op: impl Fn(&Tensor, &Tensor) -> Tensor + Sync,
    names: [&str; 3],
    what: &str,
) {
    let world = p.num_ranks() + usize::from(extra);
    let results = run_ranks(world, Duration::from_secs(30), |rank| {
        let b = NdSbp::broadcast(p.ndim());
        let lay = |i: usize| {
            make(i)
                .to_global(p, b.clone())
                .and_then(|g| g.to_global(p, nds[i].clone()))
                .unwrap()
        };
        weighted_outcome(&op, [lay(0), lay(1), lay(2)], p.contains(rank))
    });
    let want = weighted_outcome(&op, [make(0), make(1), make(2)], true).expect("read");
    assert_ranks_equal(results, &want, names, what);
}

/// The host's arg-max of a row: the first index of the largest value above -inf (a `>`-scan
/// from (0, -inf)), 0 when there is none.
pub fn first_largest(row: &[f64]) -> i64 {
    row.iter()
        .enumerate()
        .fold(
            (0, f64::NEG_INFINITY),
            |a, (i, &v)| if v > a.1 { (i, v) } else { a },
        )
        .0 as i64
}

/// Expert ids of `m` rows over `experts` experts from `seed`.
pub fn expert_ids(m: usize, experts: usize, seed: u64) -> Vec<i64> {
    lcg(seed)
        .take(m)
        .map(|s| ((s >> 33) as usize % experts) as i64)
        .collect()
}

/// `y[r] = x[r] @ w[ids[r]]` (`t`: with w transposed) on the host: x `[m, a]`, each w
/// `[k, n]` row-major.
pub fn expert_matmul_reference(
    x: &[f64],
    ids: &[i64],
    ws: &[Vec<f64>],
    k: usize,
    n: usize,
    t: bool,
) -> Vec<f64> {
    let (a, b) = if t { (n, k) } else { (k, n) };
    let mut y = vec![0.0; ids.len() * b];
    for (r, &e) in ids.iter().enumerate() {
        let w = &ws[e as usize];
        for j in 0..b {
            y[r * b + j] = (0..a)
                .map(|i| x[r * a + i] * if t { w[j * n + i] } else { w[i * n + j] })
                .sum();
        }
    }
    y
}

/// Each expert's `sum a[r]^T b[r]` on the host (a `[m, k]`, b `[m, n]`).
pub fn expert_wgrad_reference(
    a: &[f64],
    ids: &[i64],
    b: &[f64],
    e: usize,
    k: usize,
    n: usize,
) -> Vec<Vec<f64>> {
    let mut g = vec![vec![0.0; k * n]; e];
    for (r, &x) in ids.iter().enumerate() {
        for i in 0..k {
            for j in 0..n {
                g[x as usize][i * n + j] += a[r * k + i] * b[r * n + j];
            }
        }
    }
    g
}

/// Rotary inverse frequencies `base^(-2 i / d)` for heads of `d`: f64 `[d / 2]`.
pub fn rotary_frequencies(d: usize, base: f64) -> Tensor {
    let half = d / 2;
    let f: Vec<f64> = (0..half)
        .map(|i| base.powf(-2.0 * i as f64 / d as f64))
        .collect();
    Tensor::from_vec(f, [half]).unwrap()
}

/// A decoding position: one i64 `[1]`.
pub fn position(pos: usize) -> Tensor {
    Tensor::from_vec(vec![pos as i64], [1]).unwrap()
}

/// The states of a 64-bit linear congruential generator after `seed` (Knuth's constants).
fn lcg(seed: u64) -> impl Iterator<Item = u64> {
    std::iter::successors(Some(seed), |s| {
        Some(
            s.wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407),
        )
    })
    .skip(1)
}

/// `n` values in ±[0.2, 1.2) from `seed`.
pub fn never_zero(n: usize, seed: u64) -> Vec<f64> {
    lcg(seed)
        .take(n)
        .map(|s| {
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            if (s >> 40) & 1 == 0 {
                0.2 + u
            } else {
                -0.2 - u
            }
        })
        .collect()
}
