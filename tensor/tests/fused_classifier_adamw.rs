//! The fused classifier against cross-entropy (f64, value and gradient; local and on global
//! layouts against one rank; typed errors) and the multi-tensor AdamW against the three fused
//! passes (bit for bit), on local tensors and on pieces of many layouts and placements at once.

mod common;

use std::time::Duration;

use common::{bits, nd_sbp, placement, ranks_match, vals};
use oxiflow_tensor::custom::{AdamWHyper, AdamWSlot};
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
        x.classifier_loss(t).unwrap()
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
    let loss = x.classifier_loss(&targets(4, 9, 1)).unwrap();
    assert_eq!(loss.autograd().grad_fn().map(|f| f.saved_count()), Some(1));
}

#[test]
fn classifier_bad_input_is_typed() {
    let x = Tensor::randn([4, 9], 1, F);
    let e = x
        .classifier_loss(&targets(3, 9, 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("classifier") && e.contains("[3]"), "{e}");
    let e = x
        .classifier_loss(&Tensor::randn([4], 2, F))
        .unwrap_err()
        .to_string();
    assert!(e.contains("classifier") && e.contains("i64"), "{e}");
    let bad = Tensor::from_vec(vec![0i64, 9, 1, 2], [4]).unwrap();
    let e = x.classifier_loss(&bad).unwrap_err().to_string();
    assert!(e.contains("9") && e.contains("range"), "{e}");
    let e = Tensor::zeros([4, 9], DType::I64)
        .classifier_loss(&targets(4, 9, 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("classifier") && e.contains("float"), "{e}");
}

/// One AdamW step of `slots` through the three fused passes (the reference).
fn three_passes(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: &AdamWHyper,
    wd: f64,
) -> [Tensor; 3] {
    let t = h.step as i32;
    let (bc1, bc2) = (1.0 - h.beta1.powi(t), 1.0 - h.beta2.powi(t));
    let c = h.grad_scale;
    let m2 = m
        .adam_moment(g, h.beta1, (1.0 - h.beta1) * c, false)
        .unwrap();
    let v2 = v
        .adam_moment(g, h.beta2, (1.0 - h.beta2) * c * c, true)
        .unwrap();
    let p2 = p
        .adam_update(&m2, &v2, [1.0 - h.lr * wd, h.lr / bc1, 1.0 / bc2, h.eps])
        .unwrap();
    [p2, m2, v2]
}

const HYPER: AdamWHyper = AdamWHyper {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    step: 3,
    grad_scale: 0.6,
};

#[test]
fn adamw_multi_equals_the_three_passes_bit_for_bit() {
    for dt in [DType::F64, DType::F32] {
        let shapes: [&[usize]; 3] = [&[3, 4], &[5], &[0, 2]];
        let mk = |s: &[usize], seed: u64| Tensor::randn(s.to_vec(), seed, dt);
        let ts: Vec<[Tensor; 4]> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let k = 10 * i as u64;
                [
                    mk(s, k),
                    mk(s, k + 1),
                    mk(s, k + 2),
                    mk(s, k + 3).abs().unwrap(),
                ]
            })
            .collect();
        let wd = [0.1, 0.0, 0.3];
        let slots: Vec<AdamWSlot> = ts
            .iter()
            .zip(wd)
            .enumerate()
            .map(|(i, (t, w))| AdamWSlot {
                param: &t[0],
                grad: &t[1],
                // The second tensor takes its first step (zero moments).
                m: (i != 1).then_some(&t[2]),
                v: (i != 1).then_some(&t[3]),
                weight_decay: w,
                compute_copy: None,
                reuse: None,
            })
            .collect();
        let got = Tensor::adamw_multi(&slots, &HYPER).unwrap();
        for (i, (t, o)) in ts.iter().zip(&got).enumerate() {
            let zero = t[0].mul_scalar(0.0).unwrap();
            let (m, v) = if i == 1 {
                (&zero, &zero)
            } else {
                (&t[2], &t[3])
            };
            let want = three_passes(&t[0], &t[1], m, v, &HYPER, wd[i]);
            for (g, w) in [&o.param, &o.m, &o.v].iter().zip(&want) {
                assert_eq!(
                    g.to_dtype(F).unwrap().to_vec::<f64>().unwrap(),
                    w.to_dtype(F).unwrap().to_vec::<f64>().unwrap(),
                    "{dt} tensor {i}"
                );
                assert_eq!(g.dtype(), dt);
            }
        }
    }
}

/// The guarded update: a finite ratio gives `adamw_multi_clipped`'s bits, a NaN one the old
/// values (and copies of them), where the clipped update gives NaN; with and without moments'
/// reuse asked (the host writes new memory either way).
#[test]
fn adamw_multi_guarded_keeps_everything_on_a_nan_ratio() {
    let t: Vec<Tensor> = (0..4)
        .map(|k| {
            let x = Tensor::randn([4, 5], 30 + k, DType::F32);
            if k == 3 {
                x.abs().unwrap()
            } else {
                x
            }
        })
        .collect();
    let copy = t[0].to_dtype(DType::BF16).unwrap();
    for reuse in [false, true] {
        let slot = AdamWSlot {
            param: &t[0],
            grad: &t[1],
            m: Some(&t[2]),
            v: Some(&t[3]),
            weight_decay: 0.1,
            compute_copy: Some(DType::BF16),
            reuse: reuse.then_some(oxiflow_tensor::custom::AdamWReuse { copy: Some(&copy) }),
        };
        let ratio = |r: f64| Tensor::from_vec(vec![r], Vec::<usize>::new()).unwrap();
        let finite = Tensor::adamw_multi_guarded(&[slot], &HYPER, &ratio(0.4)).unwrap();
        let clipped = Tensor::adamw_multi_clipped(&[slot], &HYPER, &ratio(0.4)).unwrap();
        let (a, b) = (&finite[0], &clipped[0]);
        for (x, y) in [(&a.param, &b.param), (&a.m, &b.m), (&a.v, &b.v)] {
            assert_eq!(bits(x), bits(y));
        }
        let kept = Tensor::adamw_multi_guarded(&[slot], &HYPER, &ratio(f64::NAN)).unwrap();
        let k = &kept[0];
        for (x, old) in [(&k.param, &t[0]), (&k.m, &t[2]), (&k.v, &t[3])] {
            assert_eq!(
                bits(x),
                bits(old),
                "reuse {reuse}: a NaN ratio keeps the old values"
            );
        }
        assert_eq!(bits(k.copy.as_ref().unwrap()), bits(&copy));
        let nan = Tensor::adamw_multi_clipped(&[slot], &HYPER, &ratio(f64::NAN)).unwrap();
        assert!(nan[0]
            .param
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_nan()));
    }
}

/// The error text of one AdamW step on a slot of `param` and `grad` (m and v: `moments`).
fn adamw_error(param: &Tensor, grad: &Tensor, moments: Option<&Tensor>) -> String {
    let slot = AdamWSlot {
        param,
        grad,
        m: moments,
        v: moments,
        weight_decay: 0.0,
        compute_copy: None,
        reuse: None,
    };
    Tensor::adamw_multi(&[slot], &HYPER)
        .unwrap_err()
        .to_string()
}

#[test]
fn adamw_multi_bad_slots_are_typed() {
    let p = Tensor::randn([3, 2], 1, F);
    let g = Tensor::randn([2, 3], 2, F);
    let e = adamw_error(&p, &g, None);
    assert!(e.contains("adamw_multi") && e.contains("grad"), "{e}");
    let i = Tensor::zeros([3, 2], DType::I64);
    let e = adamw_error(&i, &i, Some(&i));
    assert!(e.contains("adamw_multi") && e.contains("float"), "{e}");
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
        mesh in prop::sample::select(vec![vec![2usize], vec![3], vec![2, 2], vec![1, 3]]),
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

    /// Tensors in many layouts at once (splits on any dim, uneven and empty shards, 1-d and
    /// 2-d meshes) and on two stage placements: each rank updates its pieces, and every result
    /// keeps its tensor's layout and equals the local step.
    #[test]
    fn adamw_multi_on_pieces_of_any_layout_equals_one_rank(
        dims in proptest::collection::vec((1usize..6, 1usize..4), 1..5),
        seeds in proptest::collection::vec(any::<u64>(), 6),
    ) {
        let mesh = placement(&[2, 2], seeds[0]);
        let stages = [stage(&[0, 1]), stage(&[2, 3])];
        let mk = |s: &[usize], k: u64| Tensor::randn(s.to_vec(), k, F);
        let local: Vec<[Tensor; 4]> = dims
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| {
                let (s, k) = ([a, b], 10 * i as u64);
                [mk(&s, k), mk(&s, k + 1), mk(&s, k + 2), mk(&s, k + 3).abs().unwrap()]
            })
            .collect();
        let want: Vec<Vec<f64>> = local
            .iter()
            .enumerate()
            .flat_map(|(i, t)| three_passes(&t[0], &t[1], &t[2], &t[3], &HYPER, 0.1 * i as f64))
            .map(|t| vals(&t))
            .collect();
        let got = run_ranks(4, Duration::from_secs(60), |rank| {
            // Tensor i lives on the mesh (even i) or a stage (odd i), in a random layout.
            let at = |i: usize| if i.is_multiple_of(2) { &mesh } else { &stages[(i / 2) % 2] };
            let globals: Vec<Vec<Tensor>> = local
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let p = at(i);
                    let nd = nd_sbp(p.ndim(), 2, seeds[1 + i % 5] ^ i as u64, false);
                    t.iter()
                        .map(|x| {
                            x.to_global(p, NdSbp::broadcast(p.ndim()))
                                .unwrap()
                                .to_global(p, nd.clone())
                                .unwrap()
                        })
                        .collect()
                })
                .collect();
            let slots: Vec<AdamWSlot> = globals
                .iter()
                .enumerate()
                .map(|(i, t)| AdamWSlot {
                    param: &t[0],
                    grad: &t[1],
                    m: Some(&t[2]),
                    v: Some(&t[3]),
                    weight_decay: 0.1 * i as f64,
                    compute_copy: [None, Some(DType::BF16), Some(DType::F16), Some(DType::F32)][i % 4],
                    reuse: None,
                })
                .collect();
            let out = Tensor::adamw_multi(&slots, &HYPER).unwrap();
            let mut vs = Vec::new();
            for (i, o) in out.iter().enumerate() {
                let p = at(i);
                // The compute copy: the new value's cast, bit for bit, in its layout.
                match (&o.copy, slots[i].compute_copy) {
                    (Some(c), Some(d)) => {
                        assert_eq!((c.dtype(), c.layout()), (d, o.param.layout()), "tensor {i}'s copy");
                        if p.contains(rank) {
                            let cast = o.param.to_dtype(d).unwrap();
                            let bits = |t: &Tensor| -> Vec<u64> {
                                vals(&t.to_local().cast(F).unwrap()).iter().map(|v| v.to_bits()).collect()
                            };
                            assert_eq!(bits(c), bits(&cast), "tensor {i}: copy vs cast on rank {rank}");
                        }
                    }
                    (None, None) => {}
                    (c, d) => panic!("tensor {i}: copy {c:?} for {d:?}"),
                }
                for t in [&o.param, &o.m, &o.v] {
                    assert_eq!(t.layout(), globals[i][0].layout(), "tensor {i} keeps its layout");
                    // Ranks outside the tensor's placement report the reference's values.
                    vs.push(if p.contains(rank) {
                        vals(&t.to_global(p, NdSbp::broadcast(p.ndim())).unwrap())
                    } else {
                        Vec::new()
                    });
                }
            }
            vs
        });
        for (rank, outs) in got.iter().enumerate() {
            for (k, (g, w)) in outs.iter().zip(&want).enumerate() {
                let inside = !g.is_empty() || w.is_empty();
                prop_assert!(!inside || g == w, "rank {rank} output {k}: {g:?} vs {w:?}");
            }
        }
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
