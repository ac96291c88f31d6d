//! SwiGLU through the public op contract: the forward and backward kernels (f32, f64, bf16 on
//! the CPU) against an f64 reference, autograd through it, the typed error of a dtype without a
//! kernel on every rank, and the global property: any layout of the operands (uneven splits,
//! broadcasts, a partial `up`, 1-d and 2-d meshes, a rank outside the placement) gives the
//! single-rank values and gradients.

mod common;

use std::time::Duration;

use common::{
    assert_layouts_equal_one_rank, assert_op_error, close, mesh_strategy, nd_sbp, placement,
    pointwise_layouts_equal_one_rank, vals,
};

use oxiflow_ops::swiglu::{swiglu, swiglu_backward, swiglu_pairs};
use oxiflow_placement::Placement;
use oxiflow_tensor::{run_ranks, DType, DeviceType, Sbp, Tensor, TensorError};
use proptest::prelude::*;

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The f64 reference of the forward and of both gradients at one element.
fn reference(g: f64, u: f64, d: f64) -> (f64, f64, f64) {
    let s = sigmoid(g);
    (g * s * u, d * u * s * (1.0 + g * (1.0 - s)), d * g * s)
}

/// Tolerance of a dtype's results against the f64 reference of its (rounded) inputs.
fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        _ => 1.6e-2,
    }
}

fn check_local(shape: &[usize], seed: u64, dt: DType) {
    let g = Tensor::randn(shape.to_vec(), seed, DType::F64)
        .scale(3.0)
        .unwrap()
        .cast(dt)
        .unwrap();
    let u = Tensor::randn(shape.to_vec(), seed + 1, dt);
    let dy = Tensor::randn(shape.to_vec(), seed + 2, dt);
    let y = swiglu(&g, &u).unwrap();
    assert_eq!((y.shape(), y.dtype()), (g.shape(), dt));
    let (dg, du) = swiglu_backward(&g, &u, &dy).unwrap();
    let (gv, uv, dv) = (vals(&g), vals(&u), vals(&dy));
    let want: Vec<(f64, f64, f64)> = (0..gv.len())
        .map(|i| reference(gv[i], uv[i], dv[i]))
        .collect();
    let tol = tolerance(dt);
    let what = format!("{dt} {shape:?}");
    close(
        &vals(&y),
        &want.iter().map(|w| w.0).collect::<Vec<_>>(),
        tol,
        &format!("{what} y"),
    );
    close(
        &vals(&dg),
        &want.iter().map(|w| w.1).collect::<Vec<_>>(),
        tol,
        &format!("{what} dgate"),
    );
    close(
        &vals(&du),
        &want.iter().map(|w| w.2).collect::<Vec<_>>(),
        tol,
        &format!("{what} dup"),
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn kernels_match_the_f64_reference(
        shape in prop::collection::vec(0usize..9, 1..=3),
        seed in any::<u32>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16]),
    ) {
        check_local(&shape, u64::from(seed), dt);
    }
}

#[test]
fn large_arrays_run_in_parallel_chunks_alike() {
    check_local(&[3, 40_000], 7, DType::F32);
    check_local(&[70_001], 8, DType::BF16);
}

#[test]
fn autograd_gives_the_kernel_gradients() {
    let g = Tensor::randn([4, 5], 1, DType::F64).requires_grad_(true);
    let u = Tensor::randn([4, 5], 2, DType::F64).requires_grad_(true);
    let r = Tensor::randn([4, 5], 3, DType::F64);
    let y = swiglu(&g, &u).unwrap();
    assert_eq!(y.grad_fn_name().as_deref(), Some("swiglu"));
    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let (dg, du) = swiglu_backward(&g, &u, &r).unwrap();
    close(&vals(&g.grad().unwrap()), &vals(&dg), 0.0, "dgate");
    close(&vals(&u.grad().unwrap()), &vals(&du), 0.0, "dup");
    // Only `up` needs a gradient: `gate` gets none.
    let g2 = Tensor::randn([4, 5], 1, DType::F64);
    let u2 = Tensor::randn([4, 5], 2, DType::F64).requires_grad_(true);
    swiglu(&g2, &u2)
        .unwrap()
        .mul(&r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(g2.grad().is_none());
    close(&vals(&u2.grad().unwrap()), &vals(&du), 0.0, "dup alone");
    // The gradients' op is not differentiable: its outputs get no autograd history.
    let (dg2, du2) = swiglu_backward(&g, &u, &r).unwrap();
    assert!(dg2.grad_fn_name().is_none() && du2.grad_fn_name().is_none());
}

#[test]
fn bad_input_is_a_typed_error() {
    let a = Tensor::randn([2, 3], 1, DType::F32);
    let e = swiglu(&a, &Tensor::randn([3, 2], 2, DType::F32)).unwrap_err();
    assert_op_error!(e, Shape, "swiglu");
    let e = swiglu(&a, &Tensor::randn([2, 3], 2, DType::F64)).unwrap_err();
    assert_op_error!(e, DType, "swiglu");
    let ids = Tensor::randn([2, 3], 2, DType::F32)
        .cast(DType::I64)
        .unwrap();
    let e = swiglu(&ids, &ids).unwrap_err();
    assert!(matches!(e, TensorError::DType { .. }), "{e}");
    let local = Tensor::randn([2, 3], 1, DType::F32);
    let p = Placement::new(DeviceType::Cpu, vec![1], vec![0]).unwrap();
    run_ranks(1, Duration::from_secs(10), |_| {
        let global = Tensor::randn_global([2, 3], 1, DType::F32, &p, Sbp::B).unwrap();
        let e = swiglu(&local, &global).unwrap_err();
        assert_op_error!(e, Mixed, "swiglu");
    });
}

#[test]
fn a_dtype_without_a_kernel_fails_alike_on_every_rank_before_communicating() {
    // f16 has a CUDA kernel but no CPU one.
    let h = Tensor::randn([2, 3], 1, DType::F16);
    let e = swiglu(&h, &h).unwrap_err();
    let TensorError::NoKernel {
        op,
        backend,
        dtypes,
        available,
    } = &e
    else {
        panic!("{e}");
    };
    assert_eq!((*op, *backend), ("swiglu", "cpu"));
    assert_eq!(dtypes, "f16, f16");
    assert!(
        available.contains("cpu for f32, f64, bf16") && available.contains("cuda"),
        "{e}"
    );
    // Global: every rank (one outside the placement too) gets the same error, and no rank
    // waits on a collective that another skipped (the split operands would be boxed first).
    let p = Placement::new(DeviceType::Cpu, vec![2], vec![0, 1]).unwrap();
    let errs = run_ranks(3, Duration::from_secs(20), |_| {
        let g = Tensor::randn_global([5, 3], 1, DType::F16, &p, Sbp::S(0)).unwrap();
        let u = Tensor::randn_global([5, 3], 2, DType::F16, &p, Sbp::S(1)).unwrap();
        swiglu(&g, &u).unwrap_err().to_string()
    });
    assert!(
        errs.iter()
            .all(|x| x == &errs[0] && x.contains("no kernel")),
        "{errs:?}"
    );
}

/// gate, up and the loss weight of `shape` on `mesh` as the seeds draw them (a partial `up`
/// among them): the value and gradients equal one rank's.
fn global_case(mesh: &[usize], perm: u64, extra: bool, shape: Vec<usize>, seeds: (u64, u64)) {
    let p = placement(mesh, perm);
    let n = shape.len();
    let nds = [
        nd_sbp(p.ndim(), n, seeds.0, false),
        nd_sbp(p.ndim(), n, seeds.1, true),
        nd_sbp(p.ndim(), n, seeds.0 ^ seeds.1, false),
    ];
    let [g_nd, u_nd, r_nd] = &nds;
    let what = format!("{mesh:?} on {p}: gate {g_nd}, up {u_nd}, r {r_nd}, shape {shape:?}");
    assert_layouts_equal_one_rank(
        &p,
        extra,
        &nds,
        |i| Tensor::randn(shape.to_vec(), i as u64 + 1, DType::F64),
        |g, u| swiglu(g, u).unwrap(),
        ["y", "dgate", "dup"],
        &what,
    );
}

pointwise_layouts_equal_one_rank!(
    shape in prop::collection::vec(1usize..8, 1..=3),
    seeds in (any::<u64>(), any::<u64>()),
);

#[test]
fn uneven_splits_and_a_partial_up_on_a_2d_mesh() {
    // 5 rows over 2 ranks and 7 columns over 3: uneven on both axes.
    global_case(&[2, 3], 0, true, vec![5, 7], (11, 12));
    global_case(&[3], 5, false, vec![7, 2], (3, 4));
}

/// The packed input's gates and ups as two tensors `[.., F]`.
fn pairs_of(x: &Tensor) -> (Tensor, Tensor) {
    let nd = x.shape().ndim();
    let dims = x.shape().dims()[..nd - 1].to_vec();
    let part = |i| x.narrow(-1, i, 1).unwrap().reshape(dims.clone()).unwrap();
    (part(0), part(1))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, max_shrink_iters: 32, ..ProptestConfig::default() })]
    /// The packed form equals `swiglu` on its gates and ups bit for bit, and on any layout (a
    /// leading dim or F split, uneven or empty pieces, or whole) one rank's values.
    #[test]
    fn swiglu_pairs_is_swiglu_of_its_parts_on_any_layout(
        lead in prop::collection::vec(1usize..5, 0..=2),
        f in 1usize..9,
        seed in any::<u64>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16]),
        mesh in mesh_strategy(),
        perm in any::<u64>(),
    ) {
        let mut shape = lead.clone();
        shape.extend([f, 2]);
        let x = Tensor::randn(shape.clone(), seed, DType::F64).cast(dt).unwrap();
        let y = swiglu_pairs(&x).unwrap();
        let (g, u) = pairs_of(&x);
        let want = vals(&swiglu(&g, &u).unwrap());
        prop_assert_eq!(vals(&y), want.clone());
        let p = placement(&mesh, perm);
        let nd = p.ndim();
        // One SBP per axis: a leading dim or F split, or broadcast.
        let choices: Vec<Sbp> = (0..=lead.len()).map(Sbp::S).chain([Sbp::B]).collect();
        let sbp = common::nd_sbp_of(nd, seed, &choices);
        let got = run_ranks(p.num_ranks(), Duration::from_secs(30), |_| {
            let xg = x
                .to_global(&p, oxiflow_tensor::NdSbp::broadcast(nd))
                .unwrap()
                .to_global(&p, sbp.clone())
                .unwrap();
            vals(&swiglu_pairs(&xg).unwrap())
        });
        for v in got {
            prop_assert_eq!(&v, &want);
        }
    }
}

#[test]
fn swiglu_pairs_needs_pairs_on_the_last_dim() {
    for shape in [vec![2usize], vec![3, 4], vec![2, 3, 1]] {
        let e = swiglu_pairs(&Tensor::zeros(shape.clone(), DType::F32))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("swiglu_pairs") && e.contains("[.., F, 2]"),
            "{shape:?}: {e}"
        );
    }
}
