//! `matmul_t` (operands transposed inside the product) against materialised transposes and
//! plain products: values and gradients, local and global (2 ranks as threads, every
//! operand split on each of its dims or broadcast).

use std::time::Duration;

use oxiflow_tensor::{run_ranks, DType, DeviceType, NdSbp, Placement, Sbp, Tensor};

const F: DType = DType::F64;

fn vals(x: &Tensor) -> Vec<f64> {
    x.to_ndarray::<f64>().unwrap().into_raw_vec_and_offset().0
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= 1e-10 * (1.0 + y.abs()),
            "{what}: {x} vs {y}"
        );
    }
}

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
                assert_close(
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
    for j in 0..3 {
        assert_close(&got[j], &want[j], "3-d a, transposed b");
    }
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
                    let g = |x: &Tensor, s: Sbp| {
                        x.to_global(&p, NdSbp::new([Sbp::B]))
                            .and_then(|t| t.to_global(&p, NdSbp::new([s])))
                            .unwrap()
                    };
                    let (a, b, w) = make();
                    run(&g(&a, xa), &g(&b, xb), &g(&w, Sbp::B), ta, tb, true)
                });
                for r in got {
                    for j in 0..3 {
                        assert_close(
                            &r[j],
                            &want[j],
                            &format!("ta {ta} tb {tb} a {xa:?} b {xb:?}"),
                        );
                    }
                }
            }
        }
    }
}
