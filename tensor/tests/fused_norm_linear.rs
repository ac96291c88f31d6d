//! The fused residual LayerNorm (the ops crate's) and linear custom ops against the ops they fuse (f64), in value
//! and gradient: on local tensors, and on global layouts (random SBPs, P inputs boxed, 1-d and
//! 2-d meshes, uneven and empty shards) against one rank; the signatures they keep (rows split,
//! column-parallel), and their typed errors.

mod common;

use std::time::Duration;

use common::{assert_vals_close, nd_sbp, one_mesh_of, placement, ranks_match, saved_count, vals};
use oxiflow_ops::linear::linear;
use oxiflow_ops::linear::Activation;
use oxiflow_ops::residual_layer_norm::{residual_layer_norm, residual_layer_norm_stats};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Sbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

/// `sum(r * cr) + sum(y * cy)` of the fused op (or the composed one), either term optional.
fn residual_loss(
    ins: &[Tensor; 4],
    c: &[Tensor; 2],
    fused: bool,
    use_r: bool,
    use_y: bool,
) -> (Tensor, Tensor, Tensor) {
    let [x, a, w, b] = ins;
    let (r, y) = if fused {
        residual_layer_norm(x, a, w, b, 1e-5).unwrap()
    } else {
        let r = x.add(a).unwrap();
        let y = r.layer_norm(w, b, 1e-5).unwrap();
        (r, y)
    };
    let mut terms = Vec::new();
    if use_r {
        terms.push(r.mul(&c[0]).unwrap().sum_all().unwrap());
    }
    if use_y {
        terms.push(y.mul(&c[1]).unwrap().sum_all().unwrap());
    }
    let loss = match terms.as_slice() {
        [a, b] => a.add(b).unwrap(),
        [a] => a.clone(),
        _ => unreachable!("at least one term"),
    };
    (loss, r, y)
}

/// Values (r, y) and gradients (x, a, w, b) of one computation on fresh leaves.
fn residual_case(
    make: &dyn Fn(&[usize], u64, usize) -> Tensor,
    shape: &[usize],
    fused: bool,
    use_r: bool,
    use_y: bool,
    gather: &dyn Fn(&Tensor) -> Vec<f64>,
) -> Vec<Vec<f64>> {
    let h = *shape.last().unwrap();
    let ins = [
        make(shape, 1, 1).requires_grad_(true),
        make(shape, 2, 2).requires_grad_(true),
        make(&[h], 3, 3).requires_grad_(true),
        make(&[h], 4, 4).requires_grad_(true),
    ];
    let c = [make(shape, 5, 5), make(shape, 6, 6)];
    let (loss, r, y) = residual_loss(&ins, &c, fused, use_r, use_y);
    loss.backward().unwrap();
    let mut out = vec![gather(&r), gather(&y)];
    // No gradient (the norm's parameters when only r is used): no values.
    for t in &ins {
        out.push(t.grad().map(|g| gather(&g)).unwrap_or_default());
    }
    out
}

#[test]
fn residual_layer_norm_equals_add_then_layer_norm() {
    let make = |s: &[usize], seed: u64, _: usize| Tensor::randn(s.to_vec(), seed, F);
    for (use_r, use_y) in [(true, true), (false, true), (true, false)] {
        let want = residual_case(&make, &[3, 4, 6], false, use_r, use_y, &vals);
        let got = residual_case(&make, &[3, 4, 6], true, use_r, use_y, &vals);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_vals_close(
                g,
                w,
                &format!("output {k} (r used {use_r}, y used {use_y})"),
            );
        }
    }
    let x = Tensor::randn([2, 5], 1, F);
    let w = Tensor::randn([5], 2, F);
    let (r, y, mean, rstd) = residual_layer_norm_stats(&x, &x, &w, &w, 1e-5).unwrap();
    assert_eq!(mean.shape().dims(), &[2, 1]);
    let (y2, m2, s2) = r.layer_norm_stats(&w, &w, 1e-5).unwrap();
    assert_vals_close(&vals(&y), &vals(&y2), "y");
    assert_vals_close(&vals(&mean), &vals(&m2), "mean");
    assert_vals_close(&vals(&rstd), &vals(&s2), "rstd");
}

#[test]
fn residual_layer_norm_keeps_the_sum_weight_and_statistics_only() {
    let x = Tensor::randn([3, 4], 1, F).requires_grad_(true);
    let w = Tensor::randn([4], 2, F).requires_grad_(true);
    let (r, y, mean, _) = residual_layer_norm_stats(&x, &x, &w, &w, 1e-5).unwrap();
    assert!(r.requires_grad() && y.requires_grad() && !mean.requires_grad());
    assert_eq!(saved_count(&y), Some(4), "r, weight, mean, rstd");
}

#[test]
fn residual_layer_norm_bad_input_is_typed() {
    let x = Tensor::randn([3, 4], 1, F);
    let w = Tensor::randn([4], 2, F);
    let e = residual_layer_norm(&x, &Tensor::randn([3, 5], 1, F), &w, &w, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("residual_layer_norm") && e.contains("[3, 5]"),
        "{e}"
    );
    let e = residual_layer_norm(&x, &x, &Tensor::randn([5], 2, F), &w, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("residual_layer_norm"), "{e}");
    let ids = Tensor::zeros([3, 4], DType::I64);
    let e = residual_layer_norm(&ids, &ids, &ids, &ids, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("residual_layer_norm") && e.contains("float"),
        "{e}"
    );
    let e = residual_layer_norm(&x, &x.to_dtype(DType::F32).unwrap(), &w, &w, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("residual_layer_norm") && e.contains("dtype"),
        "{e}"
    );
}

/// Value of y and gradients of (x, w[, b]).
fn linear_case(
    make: &dyn Fn(&[usize], u64, usize) -> Tensor,
    (rows, k, n): (usize, usize, usize),
    act: Activation,
    bias: bool,
    fused: bool,
    gather: &dyn Fn(&Tensor) -> Vec<f64>,
) -> Vec<Vec<f64>> {
    let x = make(&[rows, 3, k], 1, 1).requires_grad_(true);
    let w = make(&[k, n], 2, 2).requires_grad_(true);
    let b = make(&[n], 3, 3).requires_grad_(true);
    let c = make(&[rows, 3, n], 4, 4);
    let bias_ref = bias.then_some(&b);
    let y = if fused {
        linear(&x, &w, bias_ref, act).unwrap()
    } else {
        let y = x.matmul(&w).unwrap();
        let y = if bias { y.add(&b).unwrap() } else { y };
        if act == Activation::Gelu {
            y.gelu().unwrap()
        } else {
            y
        }
    };
    y.mul(&c).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![
        gather(&y),
        gather(&x.grad().unwrap()),
        gather(&w.grad().unwrap()),
    ];
    if bias {
        out.push(gather(&b.grad().unwrap()));
    }
    out
}

#[test]
fn linear_equals_matmul_add_gelu() {
    let make = |s: &[usize], seed: u64, _: usize| Tensor::randn(s.to_vec(), seed, F);
    for act in [Activation::None, Activation::Gelu] {
        for bias in [true, false] {
            let want = linear_case(&make, (2, 5, 4), act, bias, false, &vals);
            let got = linear_case(&make, (2, 5, 4), act, bias, true, &vals);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_vals_close(g, w, &format!("{act:?} bias {bias} output {i}"));
            }
        }
    }
}

#[test]
fn linear_gelu_saves_its_pre_activation_not_its_output() {
    let x = Tensor::randn([4, 3], 1, F).requires_grad_(true);
    let w = Tensor::randn([3, 8], 2, F).requires_grad_(true);
    let b = Tensor::randn([8], 3, F).requires_grad_(true);
    let y = linear(&x, &w, Some(&b), Activation::Gelu).unwrap();
    assert_eq!(saved_count(&y), Some(3), "x, w and the pre-activation");
    // An input that needs no gradient is not kept: a frozen x keeps w out.
    let x0 = Tensor::randn([4, 3], 1, F);
    let y = linear(&x0, &w, Some(&b), Activation::None).unwrap();
    assert_eq!(saved_count(&y), Some(1), "x only");
}

#[test]
fn linear_bad_input_is_typed() {
    let x = Tensor::randn([4, 3], 1, F);
    let e = linear(&x, &Tensor::randn([4, 2], 2, F), None, Activation::None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("linear") && e.contains("[4, 2]"), "{e}");
    let w = Tensor::randn([3, 2], 2, F);
    let e = linear(&x, &w, Some(&Tensor::randn([3], 3, F)), Activation::Gelu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("linear_gelu"), "{e}");
    let e = linear(&x, &w.to_dtype(DType::F32).unwrap(), None, Activation::None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("linear") && e.contains("dtype"), "{e}");
}

/// (x B, w S(1), b S(0)) on a mesh axis: the output is split on its features (column-parallel)
/// and the weight is not gathered; rows split with a B weight stay split.
#[test]
fn linear_keeps_column_parallel_and_row_split_layouts() {
    let p = placement(&[2], 0);
    let got = run_ranks(2, Duration::from_secs(30), |_| {
        let x = Tensor::randn_global([4, 3], 1, F, &p, NdSbp::broadcast(1)).unwrap();
        let w = Tensor::randn_global([3, 6], 2, F, &p, NdSbp::new([Sbp::S(1)])).unwrap();
        let b = Tensor::randn_global([6], 3, F, &p, NdSbp::new([Sbp::S(0)])).unwrap();
        let col = linear(&x, &w, Some(&b), Activation::Gelu).unwrap();
        let xs = Tensor::randn_global([4, 3], 1, F, &p, NdSbp::new([Sbp::S(0)])).unwrap();
        let wb = w.to_global(&p, NdSbp::broadcast(1)).unwrap();
        let bb = b.to_global(&p, NdSbp::broadcast(1)).unwrap();
        let rows = linear(&xs, &wb, Some(&bb), Activation::None).unwrap();
        (col.nd_sbp().cloned(), rows.nd_sbp().cloned())
    });
    for (col, rows) in got {
        assert_eq!(col, Some(NdSbp::new([Sbp::S(1)])));
        assert_eq!(rows, Some(NdSbp::new([Sbp::S(0)])));
    }
}

/// Whether `case(make, fused, gather)` (a computation on inputs `make(shape, seed, which)`,
/// its outputs read by `gather`) gives on every rank of `mesh` (ranks permuted by `seeds[0]`,
/// input `which` laid out as `seeds[which]` draws, outputs gathered to broadcast) the unfused
/// values of one rank; the first difference otherwise.
fn global_equals_one_rank(
    mesh: &[usize],
    seeds: &[u64],
    case: impl Fn(
            &dyn Fn(&[usize], u64, usize) -> Tensor,
            bool,
            &dyn Fn(&Tensor) -> Vec<f64>,
        ) -> Vec<Vec<f64>>
        + Sync,
) -> Result<(), String> {
    let local = |s: &[usize], seed: u64, _: usize| Tensor::randn(s.to_vec(), seed, F);
    let want = case(&local, false, &vals);
    let p = placement(mesh, seeds[0]);
    let world: usize = mesh.iter().product();
    let got = run_ranks(world, Duration::from_secs(60), |_| {
        let all_b = NdSbp::broadcast(p.ndim());
        let make = |s: &[usize], seed: u64, which: usize| {
            let nd = nd_sbp(p.ndim(), s.len(), seeds[which], true);
            Tensor::randn_global(s.to_vec(), seed, F, &p, nd).unwrap()
        };
        let gather = |t: &Tensor| vals(&t.to_global(&p, all_b.clone()).unwrap());
        case(&make, true, &gather)
    });
    ranks_match(&got, &want)
}

fn meshes() -> impl Strategy<Value = Vec<usize>> {
    one_mesh_of(&[&[2], &[3], &[2, 2], &[1, 3], &[3, 2]])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20))]
    /// Every input and upstream weight in a random layout (S on any dim, B, P): values and
    /// gradients equal one rank's composed add + layer_norm.
    #[test]
    fn residual_layer_norm_on_global_layouts_equals_one_rank(
        rows in 1usize..5,
        mesh in meshes(),
        terms in 0usize..3,
        seeds in proptest::collection::vec(any::<u64>(), 7),
    ) {
        let (use_r, use_y) = [(true, true), (false, true), (true, false)][terms];
        let shape = [rows, 3, 5];
        let res = global_equals_one_rank(&mesh, &seeds, |make, fused, gather| {
            residual_case(make, &shape, fused, use_r, use_y, gather)
        });
        prop_assert!(res.is_ok(), "{res:?}");
    }

    /// The same for the fused linear layer (none or GELU, with or without a bias).
    #[test]
    fn linear_on_global_layouts_equals_one_rank(
        rows in 1usize..4,
        k in 1usize..6,
        n in 1usize..7,
        mesh in meshes(),
        gelu in any::<bool>(),
        bias in any::<bool>(),
        seeds in proptest::collection::vec(any::<u64>(), 5),
    ) {
        let act = if gelu { Activation::Gelu } else { Activation::None };
        let res = global_equals_one_rank(&mesh, &seeds, |make, fused, gather| {
            linear_case(make, (rows, k, n), act, bias, fused, gather)
        });
        prop_assert!(res.is_ok(), "{res:?}");
    }
}
