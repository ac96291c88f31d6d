//! Context-parallel attention against one rank's attention in f64 (1e-9 relative): the output
//! and the gradients of q, k and v for a sequence split over a mesh axis in the load-balanced
//! causal order, by ring and by all-to-all, with GQA, uneven splits, CP on a 1-d mesh and beside
//! a data- or tensor-parallel axis of a 2-d mesh; a proptest over lengths, rank counts, GQA
//! ratios, orders and algorithms; bf16 and f16 operands computed wide and rounded once; the
//! typed error of an all-to-all whose heads do not divide,
//! the same on every rank before any communication.

mod common;

use std::time::Duration;

use common::vals;

use oxiflow_ops::attention::flash_attention;
use oxiflow_ops::context_parallel::{context_attention, CpAlgorithm, CpAttrs, SeqOrder};
use oxiflow_placement::Placement;
use oxiflow_tensor::{run_ranks, DType, DeviceType, F64Bits, NdSbp, Sbp, Tensor, TensorError};
use proptest::prelude::*;

/// Sizes of one case: q `[b, t, h, d]`, k `[b, t, hkv, d]`, v `[b, t, hkv, dv]`.
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    t: usize,
    h: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    causal: bool,
}

impl Case {
    fn shapes(&self) -> [Vec<usize>; 4] {
        let Case {
            b,
            t,
            h,
            hkv,
            d,
            dv,
            ..
        } = *self;
        [
            vec![b, t, h, d],
            vec![b, t, hkv, d],
            vec![b, t, hkv, dv],
            vec![b, t, h, dv],
        ]
    }
    fn scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }
}

/// The operands q, k, v and the loss weights w of a case (natural order, local).
fn operands(c: &Case) -> [Tensor; 4] {
    let s = c.shapes();
    std::array::from_fn(|i| Tensor::randn(s[i].clone(), 11 + i as u64, DType::F64))
}

fn ids(v: &[usize]) -> Tensor {
    Tensor::from_vec(v.iter().map(|&x| x as i64).collect::<Vec<_>>(), [v.len()]).unwrap()
}

/// One rank's attention: output and gradients of `sum(o * w)` by the existing fused attention
/// on k, v with each kv head repeated for its query heads.
fn reference(c: &Case) -> [Vec<f64>; 4] {
    let [q, k, v, w] = operands(c);
    let (q, k, v) = (
        q.requires_grad_(true),
        k.requires_grad_(true),
        v.requires_grad_(true),
    );
    let rep = ids(&(0..c.h).map(|h| h / (c.h / c.hkv)).collect::<Vec<_>>());
    let (kr, vr) = (
        k.index_select(2, &rep).unwrap(),
        v.index_select(2, &rep).unwrap(),
    );
    let o = flash_attention(&q, &kr, &vr, c.causal, c.scale()).unwrap();
    o.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    [
        vals(&o),
        vals(&q.grad().unwrap()),
        vals(&k.grad().unwrap()),
        vals(&v.grad().unwrap()),
    ]
}

/// The same on ranks: operands in `order` along T, laid out as `nd` on `p`; every rank's
/// gathered output and gradients back in natural order.
fn on_ranks(
    c: &Case,
    p: &Placement,
    nd: &NdSbp,
    order: SeqOrder,
    algorithm: CpAlgorithm,
) -> Vec<Result<[Vec<f64>; 4], String>> {
    let attrs = CpAttrs {
        causal: c.causal,
        scale: F64Bits::new(c.scale()),
        order,
    };
    let (pos, inv) = (ids(&order.positions(c.t)), ids(&order.indices(c.t)));
    run_ranks(p.num_ranks(), Duration::from_secs(60), |_| {
        let global = |x: &Tensor| {
            x.index_select(1, &pos)
                .unwrap()
                .to_global(p, NdSbp::broadcast(p.ndim()))
                .unwrap()
                .to_global(p, nd.clone())
                .unwrap()
                .detach()
        };
        let [q, k, v, w] = operands(c).map(|x| global(&x));
        let (q, k, v) = (
            q.requires_grad_(true),
            k.requires_grad_(true),
            v.requires_grad_(true),
        );
        let o = context_attention(&q, &k, &v, attrs, algorithm).map_err(|e| e.to_string())?;
        if o.nd_sbp() != Some(nd) {
            return Err(format!("o is {:?}, q {nd}", o.nd_sbp()));
        }
        o.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let natural = |x: &Tensor| {
            Tensor::from_array(x.to_ndarray::<f64>().unwrap())
                .index_select(1, &inv)
                .unwrap()
        };
        Ok([
            vals(&natural(&o)),
            vals(&natural(&q.grad().unwrap())),
            vals(&natural(&k.grad().unwrap())),
            vals(&natural(&v.grad().unwrap())),
        ])
    })
}

/// Asserts `got` within 1e-9 of `want`, relative to the tensor's largest element, with an
/// absolute floor of 1e-12 (the operands are O(1): a gradient that is 0 in exact arithmetic
/// comes out as round-off of either sign).
fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let big = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = (1e-9 * big).max(1e-12);
        assert!((g - w).abs() <= tol, "{what}: element {i}: {g} vs {w}");
    }
}

fn check(c: Case, mesh: &[usize], nd: NdSbp, order: SeqOrder, algorithm: CpAlgorithm) {
    let n: usize = mesh.iter().product();
    let p = Placement::new(DeviceType::Cpu, mesh.to_vec(), (0..n).collect::<Vec<_>>()).unwrap();
    let want = reference(&c);
    let what = format!("{c:?} on {mesh:?} as {nd}, {order:?}, {}", algorithm.name());
    for (rank, got) in on_ranks(&c, &p, &nd, order, algorithm)
        .into_iter()
        .enumerate()
    {
        let got = got.unwrap_or_else(|e| panic!("rank {rank}, {what}: {e}"));
        for (i, name) in ["o", "dq", "dk", "dv"].iter().enumerate() {
            close(&got[i], &want[i], &format!("rank {rank} {name}, {what}"));
        }
    }
}

/// [`check`] in the load-balanced order of `ranks` ranks, laid out `sbps` on `mesh`.
fn check_balanced(c: Case, mesh: &[usize], sbps: &[Sbp], ranks: usize, algorithm: CpAlgorithm) {
    let nd = NdSbp::new(sbps.iter().copied());
    check(c, mesh, nd, SeqOrder::Balanced { ranks }, algorithm);
}

fn gqa(b: usize, t: usize, h: usize, hkv: usize) -> Case {
    Case {
        b,
        t,
        h,
        hkv,
        d: 3,
        dv: 2,
        causal: true,
    }
}

const ALGORITHMS: [CpAlgorithm; 2] = [CpAlgorithm::Ring, CpAlgorithm::AllToAll];

#[test]
fn cp2_ring_and_alltoall_equal_one_rank() {
    for algorithm in ALGORITHMS {
        let c = gqa(2, 8, 4, 2);
        check_balanced(c, &[2], &[Sbp::S(1)], 2, algorithm);
    }
}

#[test]
fn cp4_with_an_uneven_split_equals_one_rank() {
    // 11 tokens over 4 ranks (3, 3, 3, 2), chunks of 2 and 1 tokens.
    for (c, algorithm) in [
        (gqa(1, 11, 6, 2), CpAlgorithm::Ring),
        (gqa(1, 11, 8, 4), CpAlgorithm::AllToAll),
    ] {
        check_balanced(c, &[4], &[Sbp::S(1)], 4, algorithm);
    }
}

#[test]
fn cp2_beside_a_data_parallel_axis_equals_one_rank() {
    for algorithm in ALGORITHMS {
        check_balanced(
            gqa(2, 7, 4, 2),
            &[2, 2],
            &[Sbp::S(0), Sbp::S(1)],
            2,
            algorithm,
        );
    }
}

#[test]
fn a_sequence_split_on_two_mesh_axes_rings_over_both() {
    // Inference may also split the sequence on an axis of one rank, or on a data-parallel axis
    // a batch of one row leaves free: the ring then runs over the ranks of both axes.
    for (c, mesh) in [(gqa(1, 9, 4, 2), [2, 2]), (gqa(2, 7, 4, 2), [1, 2])] {
        check_balanced(c, &mesh, &[Sbp::S(1), Sbp::S(1)], 2, CpAlgorithm::Ring);
    }
}

#[test]
fn cp2_beside_a_tensor_parallel_axis_equals_one_rank() {
    // tp (axis 0) splits heads, cp (axis 1) the sequence; the all-to-all then splits heads 4 ways.
    for (c, algorithm) in [
        (gqa(1, 9, 4, 2), CpAlgorithm::Ring),
        (gqa(1, 9, 8, 4), CpAlgorithm::AllToAll),
    ] {
        check_balanced(c, &[2, 2], &[Sbp::S(2), Sbp::S(1)], 2, algorithm);
    }
}

#[test]
fn alltoall_with_heads_not_divisible_is_refused_alike_before_communicating() {
    let p = Placement::new(DeviceType::Cpu, vec![4], (0..4).collect::<Vec<_>>()).unwrap();
    let c = gqa(1, 8, 4, 2);
    let nd = NdSbp::new([Sbp::S(1)]);
    let errs = on_ranks(
        &c,
        &p,
        &nd,
        SeqOrder::Balanced { ranks: 4 },
        CpAlgorithm::AllToAll,
    );
    let first = errs[0].as_ref().err().cloned().unwrap_or_default();
    assert!(
        first.contains("alltoall")
            && first.contains("kv heads")
            && first.contains("divisible by 4"),
        "{first}"
    );
    assert!(
        errs.iter().all(|e| e.as_ref().err() == Some(&first)),
        "{errs:?}"
    );
}

/// One rank's result for `c` with q, k, v, w rounded to `dtype` (or in f64): the output and the
/// gradients of `sum(o * w)`, as f64.
fn local_in(c: &Case, dtype: DType) -> [Vec<f64>; 4] {
    let [q, k, v, w] = operands(c).map(|x| x.cast(dtype).unwrap());
    let (q, k, v) = (
        q.requires_grad_(true),
        k.requires_grad_(true),
        v.requires_grad_(true),
    );
    let attrs = CpAttrs {
        causal: c.causal,
        scale: F64Bits::new(c.scale()),
        order: SeqOrder::Natural,
    };
    let o = context_attention(&q, &k, &v, attrs, CpAlgorithm::Ring).unwrap();
    assert_eq!(o.dtype(), dtype);
    o.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let f64s = |t: &Tensor| vals(&t.cast(DType::F64).unwrap());
    [
        f64s(&o),
        f64s(&q.grad().unwrap()),
        f64s(&k.grad().unwrap()),
        f64s(&v.grad().unwrap()),
    ]
}

#[test]
fn bf16_and_f16_compute_wide_and_round_their_results() {
    let c = gqa(2, 7, 4, 2);
    let want = local_in(&c, DType::F64);
    // 16-bit operands carry 8 (bf16) or 11 (f16) significant bits; their results stay within
    // a few of their units of the f64 result (inputs rounded once, everything computed in f64).
    for (dtype, tol) in [(DType::BF16, 3e-2), (DType::F16, 4e-3)] {
        let got = local_in(&c, dtype);
        for (i, name) in ["o", "dq", "dk", "dv"].iter().enumerate() {
            let big = want[i].iter().fold(0.0f64, |m, x| m.max(x.abs()));
            for (j, (g, w)) in got[i].iter().zip(&want[i]).enumerate() {
                assert!(
                    (g - w).abs() <= tol * big,
                    "{dtype} {name}[{j}]: {g} vs {w} (largest {big})"
                );
            }
        }
    }
}

#[test]
fn operands_that_do_not_fit_are_a_typed_error() {
    let attrs = CpAttrs {
        causal: true,
        scale: F64Bits::new(0.5),
        order: SeqOrder::Natural,
    };
    let k = Tensor::randn([1, 4, 3, 3], 1, DType::F64);
    let q = Tensor::randn([1, 4, 2, 3], 1, DType::F64);
    let e = context_attention(&q, &k, &k, attrs, CpAlgorithm::Ring).unwrap_err();
    assert!(
        matches!(e, TensorError::Shape { .. }) && e.to_string().contains("multiple"),
        "{e}"
    );
    let i = Tensor::from_vec(vec![1i64; 24], [1, 4, 2, 3]).unwrap();
    let e = context_attention(&i, &i, &i, attrs, CpAlgorithm::Ring).unwrap_err();
    assert!(e.to_string().contains("float"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, max_shrink_iters: 16, ..ProptestConfig::default() })]
    #[test]
    fn any_split_equals_one_rank(
        cp in 1usize..=4,
        t in 1usize..14,
        (hkv, ratio) in (1usize..=2, 1usize..=3),
        b in 1usize..=2,
        causal in prop::bool::weighted(0.8),
        balanced in any::<bool>(),
        ring in any::<bool>(),
    ) {
        let c = Case { b, t, h: hkv * ratio, hkv, d: 2, dv: 3, causal };
        let order = if balanced { SeqOrder::Balanced { ranks: cp } } else { SeqOrder::Natural };
        let divides = (hkv * ratio) % cp == 0 && hkv % cp == 0;
        let algorithm = if ring || !divides { CpAlgorithm::Ring } else { CpAlgorithm::AllToAll };
        check(c, &[cp], NdSbp::new([Sbp::S(1)]), order, algorithm);
    }
}
