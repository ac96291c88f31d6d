//! The mixture-of-experts ops through the public op contract: the routed product (plain and
//! transposed), its weight gradient and the router's top-k against an f64 reference on the
//! host (f32, f64, bf16), autograd through the product, typed errors for bad ids and shapes,
//! and the global property: any layout of the rows, ids and matrices (uneven splits,
//! broadcasts, partial sums, 1-d and 2-d meshes, a rank outside the placement) gives the
//! single-rank values and gradients.

mod common;

use std::time::Duration;

use common::{
    assert_op_error, close, expert_matmul_reference, expert_wgrad_reference, layouts, meshes,
    nd_sbp, placement, vals,
};

use oxiflow_ops::moe::{expert_matmul, expert_matmul_wgrad, router_topk};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Sbp, Tensor};
use proptest::prelude::*;

/// Expert ids of `m` rows over `experts` experts from `seed`.
fn ids_of(m: usize, experts: usize, seed: u64) -> Vec<i64> {
    common::expert_ids(m, experts, seed)
}

fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F64 => 1e-12,
        DType::F32 => 1e-4,
        _ => 3e-2,
    }
}

fn check_local(m: usize, k: usize, n: usize, e: usize, seed: u64, dt: DType) {
    let ids = ids_of(m, e, seed);
    let idt = Tensor::from_vec(ids.clone(), [m]).unwrap();
    let x = Tensor::randn([m, k], seed, DType::F64).cast(dt).unwrap();
    let dy = Tensor::randn([m, n], seed + 1, DType::F64)
        .cast(dt)
        .unwrap();
    let ws: Vec<Tensor> = (0..e)
        .map(|i| {
            Tensor::randn([k, n], seed + 2 + i as u64, DType::F64)
                .cast(dt)
                .unwrap()
        })
        .collect();
    let wv: Vec<Vec<f64>> = ws.iter().map(vals).collect();
    let tol = tolerance(dt);
    let what = format!("{dt} m {m} k {k} n {n} experts {e}");
    // y = x w[id], then dx = dy w[id]^T.
    for (rows, t, width) in [(&x, false, n), (&dy, true, k)] {
        let got = expert_matmul(rows, &idt, &ws, t).unwrap();
        assert_eq!((got.shape().dims(), got.dtype()), (&[m, width][..], dt));
        let want = expert_matmul_reference(&vals(rows), &ids, &wv, k, n, t);
        close(&vals(&got), &want, tol, &what);
    }
    let g = expert_matmul_wgrad(&x, &idt, &dy, e).unwrap();
    let want = expert_wgrad_reference(&vals(&x), &ids, &vals(&dy), e, k, n);
    for (i, (g, w)) in g.iter().zip(&want).enumerate() {
        close(
            &vals(g),
            w,
            tol * (m.max(1) as f64),
            &format!("{what} expert {i}"),
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn kernels_match_the_f64_reference(
        m in 0usize..12, k in 1usize..6, n in 1usize..6, e in 1usize..5,
        seed in any::<u32>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16]),
    ) {
        check_local(m, k, n, e, u64::from(seed), dt);
    }
}

#[test]
fn topk_picks_the_largest_and_counts_each_expert() {
    let p = Tensor::from_vec(
        vec![
            0.1, 0.5, 0.2, 0.2, 0.4, 0.1, 0.3, 0.2, 0.25, 0.25, 0.25, 0.25,
        ],
        [3, 4],
    )
    .unwrap();
    let (ids, counts) = router_topk(&p, 2).unwrap();
    assert_eq!(ids.to_vec::<i64>().unwrap(), vec![1, 2, 0, 2, 0, 1]);
    assert_eq!(counts.to_vec::<f64>().unwrap(), vec![2.0, 2.0, 2.0, 0.0]);
    let e = router_topk(&p, 5).unwrap_err();
    assert_op_error!(e, Shape, "router_topk");
    let e = router_topk(&p.cast(DType::BF16).unwrap(), 1).unwrap_err();
    assert_op_error!(e, DType, "router_topk");
}

#[test]
fn bad_ids_and_shapes_are_typed_errors() {
    let x = Tensor::randn([3, 2], 1, DType::F64);
    let ws = vec![Tensor::randn([2, 4], 2, DType::F64); 2];
    let out_of_range = Tensor::from_vec(vec![0i64, 2, 1], [3]).unwrap();
    let e = expert_matmul(&x, &out_of_range, &ws, false).unwrap_err();
    assert!(e.to_string().contains("expert 2 of 2"), "{e}");
    let ids = Tensor::from_vec(vec![0i64, 1, 1], [3]).unwrap();
    let e = expert_matmul(&x, &ids, &ws, true).unwrap_err();
    assert_op_error!(e, Shape, "expert_matmul");
    let e = expert_matmul(&x, &x, &ws, false).unwrap_err();
    assert_op_error!(e, DType, "expert_matmul");
}

#[test]
fn autograd_gives_the_rows_and_matrices_gradients() {
    let (m, k, n, e) = (7, 3, 4, 3);
    let ids = Tensor::from_vec(ids_of(m, e, 5), [m]).unwrap();
    let x = Tensor::randn([m, k], 1, DType::F64).requires_grad_(true);
    let ws: Vec<Tensor> = (0..e)
        .map(|i| Tensor::randn([k, n], 10 + i as u64, DType::F64).requires_grad_(true))
        .collect();
    let r = Tensor::randn([m, n], 3, DType::F64);
    let y = expert_matmul(&x, &ids, &ws, false).unwrap();
    assert_eq!(y.grad_fn_name().as_deref(), Some("expert_matmul"));
    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = expert_matmul(&r, &ids, &ws, true).unwrap();
    close(&vals(&x.grad().unwrap()), &vals(&dx), 0.0, "dx");
    let dw = expert_matmul_wgrad(&x, &ids, &r, e).unwrap();
    for (w, g) in ws.iter().zip(&dw) {
        close(&vals(&w.grad().unwrap()), &vals(g), 0.0, "dw");
    }
}

/// The forward value and the gradients of x and of every matrix of
/// `sum(expert_matmul(x, ids, ws, t) * r)`.
type Outcome = (Vec<f64>, Vec<f64>, Vec<Vec<f64>>);

#[allow(clippy::too_many_arguments)]
fn global_case(
    mesh: &[usize],
    perm: u64,
    extra: bool,
    dims: (usize, usize, usize, usize),
    t: bool,
    seed: u64,
) {
    let (m, k, n, e) = dims;
    let p = placement(mesh, perm);
    let world = p.num_ranks() + usize::from(extra);
    let x_nd = nd_sbp(p.ndim(), 2, seed, true);
    let id_nd = nd_sbp(p.ndim(), 1, seed ^ 1, false);
    let w_nd = nd_sbp(p.ndim(), 2, seed ^ 2, true);
    let ids = ids_of(m, e, seed);
    let x_shape = if t { [m, n] } else { [m, k] };
    let y_cols = if t { k } else { n };
    let bcast = NdSbp::broadcast(p.ndim());
    // Values read only where `inside` (a rank outside the placement holds none).
    let run = |global: Option<(&NdSbp, &NdSbp, &NdSbp)>, inside: bool| -> Option<Outcome> {
        let lay = |t: Tensor, nd: Option<&NdSbp>| match nd {
            Some(nd) => t
                .to_global(&p, NdSbp::broadcast(p.ndim()))
                .unwrap()
                .to_global(&p, nd.clone())
                .unwrap(),
            None => t,
        };
        let x = lay(Tensor::randn(x_shape, 1, DType::F64), global.map(|g| g.0))
            .detach()
            .requires_grad_(true);
        let idt = lay(
            Tensor::from_vec(ids.clone(), [m]).unwrap(),
            global.map(|g| g.1),
        );
        let ws: Vec<Tensor> = (0..e)
            .map(|i| {
                lay(
                    Tensor::randn([k, n], 10 + i as u64, DType::F64),
                    global.map(|g| g.2),
                )
                .detach()
                .requires_grad_(true)
            })
            .collect();
        let r = lay(
            Tensor::randn([m, y_cols], 3, DType::F64),
            global.map(|_| &bcast),
        );
        let y = expert_matmul(&x, &idt, &ws, t).unwrap();
        y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        inside.then(|| {
            (
                vals(&y),
                vals(&x.grad().unwrap()),
                ws.iter().map(|w| vals(&w.grad().unwrap())).collect(),
            )
        })
    };
    let want = run(None, true).expect("one rank's values");
    let results = run_ranks(world, Duration::from_secs(30), |rank| {
        run(Some((&x_nd, &id_nd, &w_nd)), p.contains(rank))
    });
    let what = format!("{mesh:?} on {p}: x {x_nd}, ids {id_nd}, w {w_nd}, {dims:?} t {t}");
    for (rank, got) in results.into_iter().enumerate() {
        let Some(got) = got else { continue };
        close(&got.0, &want.0, 1e-12, &format!("rank {rank} y, {what}"));
        close(&got.1, &want.1, 1e-12, &format!("rank {rank} dx, {what}"));
        for (g, w) in got.2.iter().zip(&want.2) {
            close(g, w, 1e-12, &format!("rank {rank} dw, {what}"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, max_shrink_iters: 32, ..ProptestConfig::default() })]
    #[test]
    fn any_layout_equals_one_rank(
        (mesh, perm, extra) in layouts(meshes(4, vec![vec![2, 2], vec![2, 3], vec![1, 3]])),
        dims in (1usize..9, 1usize..6, 1usize..6, 1usize..5),
        t in any::<bool>(),
        seed in any::<u64>(),
    ) {
        global_case(&mesh, perm, extra, dims, t, seed);
    }
}

#[test]
fn uneven_splits_on_a_2d_mesh() {
    // 7 rows over 2 ranks and 5 columns over 3: uneven on both axes.
    global_case(&[2, 3], 0, true, (7, 5, 5, 3), false, 11);
    global_case(&[3], 5, false, (5, 2, 7, 2), true, 4);
}

#[test]
fn topk_on_split_rows_gives_one_ranks_ids_and_counts() {
    let p = placement(&[3], 1);
    let probs = Tensor::randn([7, 5], 2, DType::F64).softmax(-1).unwrap();
    let (ids, counts) = router_topk(&probs, 2).unwrap();
    let want = (vals(&ids), vals(&counts));
    let got = run_ranks(3, Duration::from_secs(30), |_| {
        let g = Tensor::randn([7, 5], 2, DType::F64)
            .softmax(-1)
            .unwrap()
            .to_global(&p, NdSbp::broadcast(1))
            .unwrap()
            .to_global(&p, NdSbp::new([Sbp::S(0)]))
            .unwrap();
        let (ids, counts) = router_topk(&g, 2).unwrap();
        (vals(&ids), vals(&counts))
    });
    assert!(got.iter().all(|g| *g == want), "{got:?} vs {want:?}");
}
