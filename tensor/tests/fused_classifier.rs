//! The fused classifier against cross-entropy (f64, value and gradient; local and on global
//! layouts against one rank; typed errors), and the casts that stand for a copy made already
//! (`cast_as_copy`, `cast_boxed_as_copy`) against the casts themselves.

mod common;

use std::time::Duration;

use common::{nd_sbp, placement, ranks_match, saved_count, small_meshes, vals};
use oxiflow_ops::classifier::classifier_loss;
use oxiflow_tensor::{run_ranks, DType, DeviceType, NdSbp, Placement, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

fn targets(rows: usize, classes: usize, seed: u64) -> Tensor {
    let ids: Vec<i64> = (0..rows)
        .map(|i| ((i as u64 * 7 + seed * 13) % classes as u64) as i64)
        .collect();
    Tensor::from_vec(ids, [rows]).unwrap()
}

/// Loss values and the logits' gradient of `sum(loss * c)`.
fn classifier_case(logits: &Tensor, t: &Tensor, c: &Tensor, fused: bool) -> (Tensor, Tensor) {
    let x = logits.detach().requires_grad_(true);
    let loss = if fused {
        classifier_loss(&x, t).unwrap()
    } else {
        x.cross_entropy(t).unwrap()
    };
    loss.mul(c).unwrap().sum_all().unwrap().backward().unwrap();
    (loss, x.grad().unwrap())
}

#[test]
fn classifier_equals_cross_entropy() {
    let (rows, v) = (6, 11);
    let x = Tensor::randn([rows, v], 1, F).mul_scalar(3.0).unwrap();
    let t = targets(rows, v, 2);
    let c = Tensor::randn([rows], 3, F);
    let (l1, g1) = classifier_case(&x, &t, &c, true);
    let (l0, g0) = classifier_case(&x, &t, &c, false);
    for (a, b) in vals(&l1)
        .iter()
        .zip(vals(&l0))
        .chain(vals(&g1).iter().zip(vals(&g0)))
    {
        assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
    }
    // f32 logits give an f32 loss; 16-bit logits an f32 loss and a gradient of their dtype.
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let xl = x.to_dtype(dt).unwrap();
        let (l, g) = classifier_case(&xl, &t, &c.to_dtype(DType::F32).unwrap(), true);
        assert_eq!((l.dtype(), g.dtype()), (DType::F32, dt));
    }
}

#[test]
fn classifier_keeps_only_the_logits_gradient() {
    let x = Tensor::randn([4, 9], 1, F).requires_grad_(true);
    let loss = classifier_loss(&x, &targets(4, 9, 1)).unwrap();
    assert_eq!(saved_count(&loss), Some(1));
}

#[test]
fn classifier_bad_input_is_typed() {
    let x = Tensor::randn([4, 9], 1, F);
    let e = classifier_loss(&x, &targets(3, 9, 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("classifier") && e.contains("[3]"), "{e}");
    let e = classifier_loss(&x, &Tensor::randn([4], 2, F))
        .unwrap_err()
        .to_string();
    assert!(e.contains("classifier") && e.contains("i64"), "{e}");
    let bad = Tensor::from_vec(vec![0i64, 9, 1, 2], [4]).unwrap();
    let e = classifier_loss(&x, &bad).unwrap_err().to_string();
    assert!(e.contains("9") && e.contains("range"), "{e}");
    let e = classifier_loss(&Tensor::zeros([4, 9], DType::I64), &targets(4, 9, 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("classifier") && e.contains("float"), "{e}");
}

/// A stage placement holding only `ranks` of the world.
fn stage(ranks: &[usize]) -> Placement {
    Placement::new_1d(DeviceType::Cpu, ranks.to_vec()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20))]
    /// Logits and the upstream weights in random layouts (S on either dim, B, P), targets split
    /// or whole: the loss and the logits' gradient equal one rank's cross-entropy.
    #[test]
    fn classifier_on_global_layouts_equals_one_rank(
        rows in 1usize..7,
        v in 1usize..9,
        mesh in small_meshes(),
        seeds in proptest::collection::vec(any::<u64>(), 4),
    ) {
        let x = Tensor::randn([rows, v], 1, F);
        let c = Tensor::randn([rows], 2, F);
        let t = targets(rows, v, seeds[3] % 5);
        let (l, g) = classifier_case(&x, &t, &c, false);
        let want = vec![vals(&l), vals(&g)];
        let p = placement(&mesh, seeds[0]);
        let n: usize = mesh.iter().product();
        let got = run_ranks(n, Duration::from_secs(60), |_| {
            let all_b = NdSbp::broadcast(p.ndim());
            let x = Tensor::randn_global([rows, v], 1, F, &p, nd_sbp(p.ndim(), 2, seeds[1], true)).unwrap();
            let c = Tensor::randn_global([rows], 2, F, &p, nd_sbp(p.ndim(), 1, seeds[2], true)).unwrap();
            let t = t
                .to_global(&p, all_b.clone())
                .unwrap()
                .to_global(&p, nd_sbp(p.ndim(), 1, seeds[3], false))
                .unwrap();
            let (l, g) = classifier_case(&x, &t, &c, true);
            [l, g]
                .iter()
                .map(|t| vals(&t.to_global(&p, all_b.clone()).unwrap()))
                .collect::<Vec<_>>()
        });
        let res = ranks_match(&got, &want);
        prop_assert!(res.is_ok(), "{res:?}");
    }
}

/// The gradient of `leaf` after a backward pass of `sum((x wc)^2)`, `wc` computed from it.
fn grad_of_squared_product(x: &Tensor, leaf: &Tensor, wc: &Tensor) -> Tensor {
    x.matmul(wc)
        .unwrap()
        .square()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    leaf.grad().unwrap()
}

/// `cast_as_copy` stands for the cast: the same values (the copy's), recorded by autograd as
/// the cast of the leaf, so the leaf's gradient is the one `to_dtype` gives, in its dtype;
/// a tensor that is not a copy of it (shape, layout, integer dtype) is a typed error.
#[test]
fn a_cast_as_copy_is_recorded_as_the_cast() {
    let w = Tensor::randn([5, 4], 1, DType::F32).requires_grad_(true);
    let x = Tensor::randn([3, 5], 2, DType::BF16);
    let grad_through = |wc: Tensor| {
        w.zero_grad();
        grad_of_squared_product(&x, &w, &wc)
    };
    let copy = w.detach().to_dtype(DType::BF16).unwrap();
    let via_copy = w.cast_as_copy(&copy).unwrap();
    assert_eq!(via_copy.grad_fn_name().as_deref(), Some("cast"));
    assert_eq!(via_copy.dtype(), DType::BF16);
    let g_copy = grad_through(via_copy);
    let g_cast = grad_through(w.to_dtype(DType::BF16).unwrap());
    assert_eq!(g_copy.dtype(), DType::F32);
    assert_eq!(
        vals(&g_copy.cast(F).unwrap()),
        vals(&g_cast.cast(F).unwrap())
    );
    for bad in [
        Tensor::randn([4, 5], 3, DType::BF16),
        Tensor::from_vec(vec![0i64; 20], [5, 4]).unwrap(),
    ] {
        let e = w.cast_as_copy(&bad).unwrap_err().to_string();
        assert!(e.contains("cast_as_copy"), "{e}");
    }
    let e = run_ranks(2, Duration::from_secs(30), |_| {
        let p = stage(&[0, 1]);
        let g = w.to_global(&p, NdSbp::broadcast(1)).unwrap();
        let split = copy
            .to_global(&p, NdSbp::new([oxiflow_tensor::Sbp::S(0)]))
            .unwrap();
        g.cast_as_copy(&split).unwrap_err().to_string()
    });
    assert!(e[0].contains("not a copy"), "{}", e[0]);
}

/// `cast_boxed_as_copy` stands for the cast and a boxing of a leaf (a master shard and its
/// gathered 16-bit copy): the copy's values, recorded by autograd as the cast alone, so the
/// leaf's gradient arrives as the whole partial sum in the leaf's dtype and its grad layout
/// boxes it, giving a whole leaf's gradient bit for bit; a tensor with history, a local one or
/// a copy of another shape is a typed error.
#[test]
fn a_cast_boxed_as_copy_is_recorded_as_the_cast_alone() {
    let w = Tensor::randn([6, 4], 1, DType::F32);
    let x = Tensor::randn([4, 6], 2, DType::BF16);
    let runs = run_ranks(2, Duration::from_secs(30), |_| {
        let p = stage(&[0, 1]);
        let (b, s0) = (NdSbp::broadcast(1), NdSbp::new([oxiflow_tensor::Sbp::S(0)]));
        // Rows of the batch split over the ranks: the weight's gradient is a partial sum.
        let x = x
            .to_global(&p, b.clone())
            .unwrap()
            .to_global(&p, s0.clone())
            .unwrap();
        let grad_through = |leaf: &Tensor, wc: Tensor| grad_of_squared_product(&x, leaf, &wc);
        let whole = w.to_global(&p, b.clone()).unwrap().requires_grad_(true);
        whole.set_grad_layout(s0.clone()).unwrap();
        let want = grad_through(&whole, whole.to_dtype(DType::BF16).unwrap());
        let shard = w
            .to_global(&p, b.clone())
            .unwrap()
            .to_global(&p, s0.clone())
            .unwrap()
            .requires_grad_(true);
        shard.set_grad_layout(s0.clone()).unwrap();
        let copy = {
            let _ng = oxiflow_tensor::no_grad();
            shard
                .to_dtype(DType::BF16)
                .unwrap()
                .to_global(&p, b.clone())
                .unwrap()
        };
        let via = shard.cast_boxed_as_copy(&copy).unwrap();
        assert_eq!(via.grad_fn_name().as_deref(), Some("cast"));
        assert_eq!((via.dtype(), via.nd_sbp()), (DType::BF16, Some(&b)));
        assert!(via.shares_piece(&copy), "no kernel, no communication");
        let got = grad_through(&shard, via);
        assert_eq!((got.dtype(), got.nd_sbp()), (DType::F32, Some(&s0)));
        // Without a grad layout the gradient stays the whole partial sum.
        let loose = shard.detach().requires_grad_(true);
        let partial = grad_through(&loose, loose.cast_boxed_as_copy(&copy).unwrap());
        assert!(partial.nd_sbp().unwrap().as_slice()[0].is_partial());
        let errs = [
            shard.mul_scalar(1.0).unwrap().cast_boxed_as_copy(&copy),
            shard.cast_boxed_as_copy(&copy.narrow(0, 0, 3).unwrap()),
            w.cast_boxed_as_copy(&w.to_dtype(DType::BF16).unwrap()),
        ]
        .map(|r| r.unwrap_err().to_string());
        for e in &errs {
            assert!(e.contains("cast_boxed_as_copy"), "{e}");
        }
        let f = |t: &Tensor| vals(&t.to_global(&p, b.clone()).unwrap().cast(F).unwrap());
        (f(&got), f(&want), f(&partial))
    });
    for (got, want, partial) in &runs {
        assert_eq!(got, want, "the whole leaf's gradient");
        assert_eq!(partial, want, "summed");
    }
}
