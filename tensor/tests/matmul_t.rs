//! `matmul_t` (operands transposed inside the product) against materialised transposes and
//! plain products: values and gradients, local and global (2 ranks as threads, every
//! operand split on each of its dims or broadcast).

mod common;

use std::time::Duration;

use common::{assert_outputs_close, assert_vals_close, boxed_from_b, ordered_placement, vals};
use oxiflow_tensor::{run_ranks, DType, DeviceType, NdSbp, Placement, Sbp, Tensor};

const F: DType = DType::F64;

/// Stored shapes of (a, b) for op(a) [.., m, k] @ op(b) [.., k, n].
fn stored(
    batch: &[usize],
    (m, k, n): (usize, usize, usize),
    ta: bool,
    tb: bool,
) -> (Vec<usize>, Vec<usize>) {
    let mut a = batch.to_vec();
    a.extend(if ta { [k, m] } else { [m, k] });
    let mut b = if batch.is_empty() {
        vec![]
    } else {
        batch.to_vec()
    };
    b.extend(if tb { [n, k] } else { [k, n] });
    (a, b)
}

fn t_last(x: &Tensor, on: bool) -> Tensor {
    if on {
        x.transpose(-2, -1).unwrap()
    } else {
        x.clone()
    }
}

/// (value, grad a, grad b) of sum(op(a) op(b) * w) through `matmul_t` or through transposes.
fn run(a: &Tensor, b: &Tensor, w: &Tensor, ta: bool, tb: bool, fused: bool) -> [Vec<f64>; 3] {
    let (a, b) = (
        a.detach().requires_grad_(true),
        b.detach().requires_grad_(true),
    );
    let y = if fused {
        a.matmul_t(&b, ta, tb).unwrap()
    } else {
        t_last(&a, ta).matmul(&t_last(&b, tb)).unwrap()
    };
    y.mul(w).unwrap().sum_all().unwrap().backward().unwrap();
    [vals(&y), vals(&a.grad().unwrap()), vals(&b.grad().unwrap())]
}

#[test]
fn local_matmul_t_equals_transposes() {
    let flags = [(false, false), (false, true), (true, false), (true, true)];
    for (batch, mkn) in [(vec![], (5, 3, 4)), (vec![2, 3], (4, 6, 2))] {
        for (i, &(ta, tb)) in flags.iter().enumerate() {
            let (sa, sb) = stored(&batch, mkn, ta, tb);
            let a = Tensor::randn(sa, 10 + i as u64, F);
            let b = Tensor::randn(sb, 20 + i as u64, F);
            let mut so = batch.clone();
            so.extend([mkn.0, mkn.2]);
            let w = Tensor::randn(so, 30, F);
            let got = run(&a, &b, &w, ta, tb, true);
            let want = run(&a, &b, &w, ta, tb, false);
            for (j, what) in ["value", "grad a", "grad b"].iter().enumerate() {
                assert_vals_close(
                    &got[j],
                    &want[j],
                    &format!("{batch:?} ta {ta} tb {tb}: {what}"),
                );
            }
        }
    }
    // a [B, T, k] @ b [n, k]^T (the tied output projection's shape) and its gradients.
    let a = Tensor::randn([2, 3, 4], 1, F);
    let b = Tensor::randn([5, 4], 2, F);
    let w = Tensor::randn([2, 3, 5], 3, F);
    let got = run(&a, &b, &w, false, true, true);
    let want = run(&a, &b, &w, false, true, false);
    assert_outputs_close(&got, &want, "3-d a, transposed b");
}

#[test]
fn bad_shapes_are_errors() {
    let a = Tensor::randn([2, 3, 4], 1, F);
    let b = Tensor::randn([5, 4], 2, F);
    assert!(a.matmul_t(&b, false, false).is_err(), "k mismatch");
    assert!(
        a.matmul_t(&b, true, true).is_err(),
        "transposed a must be 2-d"
    );
    let v = Tensor::randn([4], 3, F);
    assert!(v.matmul_t(&b, false, true).is_err(), "a must have 2 dims");
}

#[test]
fn global_matmul_t_equals_local() {
    let flags = [(false, true), (true, false), (true, true)];
    let (m, k, n) = (6, 4, 8);
    let sbps = [Sbp::S(0), Sbp::S(1), Sbp::B];
    for &(ta, tb) in &flags {
        let (sa, sb) = stored(&[], (m, k, n), ta, tb);
        let make = || {
            (
                Tensor::randn(sa.clone(), 5, F),
                Tensor::randn(sb.clone(), 6, F),
                Tensor::randn([m, n], 7, F),
            )
        };
        let (a, b, w) = make();
        let want = run(&a, &b, &w, ta, tb, false);
        for xa in sbps {
            for xb in sbps {
                let got = run_ranks(2, Duration::from_secs(30), |_| {
                    let p = Placement::new_1d(DeviceType::Cpu, [0, 1]).unwrap();
                    let g = |x: &Tensor, s: Sbp| boxed_from_b(x, &p, &NdSbp::new([s]));
                    let (a, b, w) = make();
                    run(&g(&a, xa), &g(&b, xb), &g(&w, Sbp::B), ta, tb, true)
                });
                for r in got {
                    assert_outputs_close(&r, &want, &format!("ta {ta} tb {tb} a {xa:?} b {xb:?}"));
                }
            }
        }
    }
}

/// (value, grads of a, b and acc) of sum((op(a) op(b) + acc) * w), through `matmul_t_acc`
/// (`fused`) or a product and an add.
fn run_acc(
    (a, b, acc, w): (&Tensor, &Tensor, &Tensor, &Tensor),
    (ta, tb): (bool, bool),
    fused: bool,
) -> [Vec<f64>; 4] {
    let (a, b, acc) = (
        a.detach().requires_grad_(true),
        b.detach().requires_grad_(true),
        acc.detach().requires_grad_(true),
    );
    let y = if fused {
        a.matmul_t_acc(&b, ta, tb, &acc).unwrap()
    } else {
        a.matmul_t(&b, ta, tb).unwrap().add(&acc).unwrap()
    };
    y.mul(w).unwrap().sum_all().unwrap().backward().unwrap();
    [
        vals(&y),
        vals(&a.grad().unwrap()),
        vals(&b.grad().unwrap()),
        vals(&acc.grad().unwrap()),
    ]
}

#[test]
fn matmul_t_acc_equals_the_product_plus_the_accumulator() {
    // Local: 2-d and batched, every transpose; m = 5 splits unevenly on 2 ranks below.
    let flags = [(false, false), (false, true), (true, false), (true, true)];
    for (batch, mkn) in [(vec![], (5, 3, 4)), (vec![2], (4, 6, 2))] {
        for &(ta, tb) in &flags {
            let (sa, sb) = stored(&batch, mkn, ta, tb);
            let mut so = batch.clone();
            so.extend([mkn.0, mkn.2]);
            let ops = (
                &Tensor::randn(sa, 1, F),
                &Tensor::randn(sb, 2, F),
                &Tensor::randn(so.clone(), 3, F),
                &Tensor::randn(so, 4, F),
            );
            let got = run_acc(ops, (ta, tb), true);
            let want = run_acc(ops, (ta, tb), false);
            assert_outputs_close(&got, &want, &format!("{batch:?} {ta} {tb}"));
        }
    }
    // Global, on 2 ranks and on a 2x2 mesh: x [m, k] @ w [n, k]^T + acc (a linear layer's
    // input gradient), operands split, broadcast or partial, the accumulator partial too.
    let (m, k, n) = (5, 4, 6);
    let make = || {
        (
            Tensor::randn([m, k], 5, F),
            Tensor::randn([n, k], 6, F),
            Tensor::randn([m, n], 7, F),
            Tensor::randn([m, n], 8, F),
        )
    };
    let (a, b, acc, w) = make();
    let want = run_acc((&a, &b, &acc, &w), (false, true), false);
    let cases: [(&[usize], [NdSbp; 3]); 5] = [
        (
            &[2],
            [
                NdSbp::new([Sbp::S(0)]),
                NdSbp::new([Sbp::B]),
                NdSbp::new([Sbp::S(0)]),
            ],
        ),
        (
            &[2],
            [
                NdSbp::new([Sbp::S(1)]),
                NdSbp::new([Sbp::S(1)]),
                NdSbp::new([Sbp::P]),
            ],
        ),
        (
            &[2],
            [
                NdSbp::new([Sbp::B]),
                NdSbp::new([Sbp::S(0)]),
                NdSbp::new([Sbp::P]),
            ],
        ),
        (
            &[2, 2],
            [
                NdSbp::new([Sbp::S(0), Sbp::S(1)]),
                NdSbp::new([Sbp::B, Sbp::S(1)]),
                NdSbp::new([Sbp::P, Sbp::P]),
            ],
        ),
        (
            &[2, 2],
            [
                NdSbp::new([Sbp::B, Sbp::B]),
                NdSbp::new([Sbp::S(0), Sbp::B]),
                NdSbp::new([Sbp::S(1), Sbp::B]),
            ],
        ),
    ];
    for (mesh, [sa, sb, sc]) in cases {
        let ranks: usize = mesh.iter().product();
        let got = run_ranks(ranks, Duration::from_secs(30), |_| {
            let p = ordered_placement(mesh);
            let all_b = NdSbp::broadcast(mesh.len());
            let g = |x: &Tensor, s: &NdSbp| boxed_from_b(x, &p, s);
            let (a, b, acc, w) = make();
            let ops = (&g(&a, &sa), &g(&b, &sb), &g(&acc, &sc), &g(&w, &all_b));
            run_acc(ops, (false, true), true)
        });
        for r in got {
            assert_outputs_close(&r, &want, &format!("{mesh:?} {sa:?} {sb:?} {sc:?}"));
        }
    }
    // An accumulator of another shape or dtype is an error.
    let (x, w) = (Tensor::randn([3, 4], 1, F), Tensor::randn([5, 4], 2, F));
    for bad in [
        Tensor::randn([3, 4], 3, F),
        Tensor::randn([3, 5], 3, DType::F32),
    ] {
        assert!(x.matmul_t_acc(&w, false, true, &bad).is_err());
    }
}

/// The matmul precision is an attribute of the ops that run products: a product at another
/// precision is another dispatch-cache entry (equal ones share one), while on the CPU, which
/// has no TF32 or bf16 products, every precision gives the f32 product's bits, forward and
/// backward (the backward's products carry the forward's precision).
#[test]
fn matmul_precision_keys_the_dispatch_cache_and_changes_no_cpu_bits() {
    use oxiflow_ops::linear::{linear_at, Activation};
    use oxiflow_tensor::MatmulPrecision;

    let p = Placement::new(DeviceType::Cpu, vec![2], vec![0, 1]).unwrap();
    let got = run_ranks(2, Duration::from_secs(30), |_| {
        let a = Tensor::randn_global([6, 5], 3, DType::F32, &p, Sbp::S(0)).unwrap();
        let w = Tensor::randn_global([5, 4], 4, DType::F32, &p, Sbp::B).unwrap();
        let bias = Tensor::randn_global([4], 5, DType::F32, &p, Sbp::B).unwrap();
        let ctx = a.context().unwrap().clone();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_vec::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        };
        // Values and gradients of a product, a transposed product and a linear layer.
        let run = |mp: MatmulPrecision| -> Vec<Vec<u32>> {
            let (a, w) = (
                a.detach().requires_grad_(true),
                w.detach().requires_grad_(true),
            );
            let y = a.matmul_at(&w, mp).unwrap();
            let z = y.matmul_t_at(&w, (false, true), mp).unwrap();
            let l = linear_at(&a, &w, Some(&bias), Activation::Gelu, mp).unwrap();
            z.sum_all()
                .unwrap()
                .add(&l.sum_all().unwrap())
                .unwrap()
                .backward()
                .unwrap();
            vec![
                bits(&y),
                bits(&z),
                bits(&l),
                bits(&a.grad().unwrap()),
                bits(&w.grad().unwrap()),
            ]
        };
        let f32_bits = run(MatmulPrecision::F32);
        let n = ctx.dispatch_cache_len();
        let _ = a.matmul_at(&w, MatmulPrecision::F32).unwrap();
        assert_eq!(
            ctx.dispatch_cache_len(),
            n,
            "an equal precision: the same entry"
        );
        let _ = a.matmul_at(&w, MatmulPrecision::Tf32).unwrap();
        assert_eq!(
            ctx.dispatch_cache_len(),
            n + 1,
            "another precision: another entry"
        );
        let _ = a.matmul_at(&w, MatmulPrecision::Tf32).unwrap();
        assert_eq!(ctx.dispatch_cache_len(), n + 1);
        (
            f32_bits,
            run(MatmulPrecision::Tf32),
            run(MatmulPrecision::Bf16),
        )
    });
    for (f32_bits, tf32_bits, bf16_bits) in got {
        assert_eq!(f32_bits, tf32_bits, "tf32 changes nothing on the CPU");
        assert_eq!(
            f32_bits, bf16_bits,
            "bf16 products change nothing on the CPU"
        );
    }
}
