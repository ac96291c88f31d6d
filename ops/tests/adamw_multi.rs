//! The multi-tensor AdamW against the three fused passes (bit for bit), on local tensors and
//! on pieces of many layouts and placements at once; its clip ratio and the guarded update
//! that a NaN ratio skips; its typed errors; and its slots' memory reuse, which the host (and a
//! capture) never does: the same bits as without, its operands unchanged.

mod common;

use std::time::Duration;

use common::{bits, nd_sbp, placement, vals};
use oxiflow_ops::adamw::{
    adam_moment, adam_update, adamw_multi, adamw_multi_clipped, adamw_multi_guarded, AdamWHyper,
    AdamWReuse, AdamWSlot, AdamWUpdated,
};
use oxiflow_tensor::{run_ranks, DType, DeviceType, NdSbp, Placement, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

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
    let m2 = adam_moment(m, g, h.beta1, (1.0 - h.beta1) * c, false).unwrap();
    let v2 = adam_moment(v, g, h.beta2, (1.0 - h.beta2) * c * c, true).unwrap();
    let p2 = adam_update(p, &m2, &v2, [1.0 - h.lr * wd, h.lr / bc1, 1.0 / bc2, h.eps]).unwrap();
    [p2, m2, v2]
}

/// The slot of `t` (param, gradient, m, v) with both moments: a step after the first.
fn full_slot<'a>(
    t: &'a [Tensor],
    weight_decay: f64,
    compute_copy: Option<DType>,
    reuse: Option<AdamWReuse<'a>>,
) -> AdamWSlot<'a> {
    AdamWSlot {
        param: &t[0],
        grad: &t[1],
        m: Some(&t[2]),
        v: Some(&t[3]),
        weight_decay,
        compute_copy,
        reuse,
    }
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
        let got = adamw_multi(&slots, &HYPER).unwrap();
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
        let reused = reuse.then_some(AdamWReuse { copy: Some(&copy) });
        let slot = full_slot(&t, 0.1, Some(DType::BF16), reused);
        let ratio = |r: f64| Tensor::from_vec(vec![r], Vec::<usize>::new()).unwrap();
        let finite = adamw_multi_guarded(&[slot], &HYPER, &ratio(0.4)).unwrap();
        let clipped = adamw_multi_clipped(&[slot], &HYPER, &ratio(0.4)).unwrap();
        let (a, b) = (&finite[0], &clipped[0]);
        for (x, y) in [(&a.param, &b.param), (&a.m, &b.m), (&a.v, &b.v)] {
            assert_eq!(bits(x), bits(y));
        }
        let kept = adamw_multi_guarded(&[slot], &HYPER, &ratio(f64::NAN)).unwrap();
        let k = &kept[0];
        for (x, old) in [(&k.param, &t[0]), (&k.m, &t[2]), (&k.v, &t[3])] {
            assert_eq!(
                bits(x),
                bits(old),
                "reuse {reuse}: a NaN ratio keeps the old values"
            );
        }
        assert_eq!(bits(k.copy.as_ref().unwrap()), bits(&copy));
        let nan = adamw_multi_clipped(&[slot], &HYPER, &ratio(f64::NAN)).unwrap();
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
    adamw_multi(&[slot], &HYPER).unwrap_err().to_string()
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
                .map(|(i, t)| {
                    let copy = [None, Some(DType::BF16), Some(DType::F16), Some(DType::F32)][i % 4];
                    full_slot(t, 0.1 * i as f64, copy, None)
                })
                .collect();
            let out = adamw_multi(&slots, &HYPER).unwrap();
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

fn same(a: &AdamWUpdated, b: &AdamWUpdated) -> bool {
    let pairs = [(&a.param, &b.param), (&a.m, &b.m), (&a.v, &b.v)];
    pairs.iter().all(|(x, y)| bits(x) == bits(y))
        && match (&a.copy, &b.copy) {
            (Some(x), Some(y)) => bits(x) == bits(y),
            (None, None) => true,
            _ => false,
        }
}

#[test]
fn adamw_reuse_on_the_host_writes_new_memory() {
    let four = |seed: u64| {
        [0, 1, 2, 3].map(|k| {
            let t = Tensor::randn([5, 7], seed + k, DType::F32);
            if k == 3 {
                t.abs().unwrap()
            } else {
                t
            }
        })
    };
    let (a, b) = (four(10), four(20));
    let copy = a[0].to_dtype(DType::BF16).unwrap();
    let before: Vec<Vec<u64>> = a.iter().chain(&b).map(bits).collect();
    let hyper = AdamWHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        step: 2,
        grad_scale: 0.5,
    };
    let slots = |reuse: bool| {
        vec![
            full_slot(
                &a,
                0.1,
                Some(DType::BF16),
                reuse.then_some(AdamWReuse { copy: Some(&copy) }),
            ),
            full_slot(&b, 0.0, None, reuse.then_some(AdamWReuse::default())),
        ]
    };
    let want = adamw_multi(&slots(false), &hyper).unwrap();
    let got = adamw_multi(&slots(true), &hyper).unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!(same(g, w));
    }
    assert!(
        !got[0].param.shares_piece(&a[0]),
        "the host writes new memory"
    );
    assert!(!got[0].copy.as_ref().unwrap().shares_piece(&copy));
    let after: Vec<Vec<u64>> = a.iter().chain(&b).map(bits).collect();
    assert_eq!(before, after, "the operands are unchanged");
}
