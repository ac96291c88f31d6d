//! The vocabulary-parallel cross-entropy's fused kernels against an f64 single-rank reference
//! on random, never-zero logits: the per-shard log-sum-exp op (`LossOp::VocabParallelLse`:
//! one column per class shard, the shard's class columns only, -inf for a shard of padding)
//! and the padded loss and gradient through `cross_entropy_padded` and
//! `classifier_loss_padded`, in f64, f32 and bf16, on 1-d and 2-d meshes with classes split
//! unevenly (shards of padding only, empty shards, `classes == C`, partial logits): values,
//! dtypes, layouts, a padding gradient of exactly 0, no rows, and bad input refused as on
//! whole logits.

mod common;

use std::time::Duration;

use common::{log_sum_exp as lse, padded_cross_entropy_reference as reference, placement, vals};
use oxiflow_ops::classifier::classifier_loss_padded;
use oxiflow_tensor::{
    dispatch, run_ranks, ClassShard, DType, GlobalLayout, LossOp, NdSbp, Op, Placement, Sbp, Shape,
    Tensor,
};
use proptest::prelude::*;

const F: DType = DType::F64;
const B: Sbp = Sbp::B;
#[allow(non_snake_case)]
fn S(d: usize) -> Sbp {
    Sbp::S(d)
}

/// Logits: `3 randn` (the same values in every layout).
fn logits_of(x: Tensor) -> Tensor {
    x.mul_scalar(3.0).unwrap()
}

/// The reference's logits, checked to hold no zero.
fn never_zero(x: Vec<f64>) -> Vec<f64> {
    assert!(x.iter().all(|&v| v != 0.0), "a zero logit");
    x
}

/// The rounding of `dtype`'s compute (f64: a few ulps; 16-bit logits compute in f32).
fn tolerance(dtype: DType) -> f64 {
    if dtype == F {
        1e-12
    } else {
        2e-5
    }
}

fn close(got: f64, want: f64, tol: f64) -> bool {
    (got == want) || (got - want).abs() <= tol * (1.0 + want.abs())
}

/// Expected partials `[rows, parts]`: for every rank, the f64 log-sum-exp of its logits
/// columns below `classes`, in the column its output region starts at.
fn expected_partials(
    x: &[f64],
    rows: usize,
    width: usize,
    classes: usize,
    p: &Placement,
    sbp: &NdSbp,
    parts: usize,
) -> Vec<f64> {
    let xl = GlobalLayout::new([rows, width], p, sbp.clone()).unwrap();
    let ol = GlobalLayout::new([rows, parts], p, sbp.clone()).unwrap();
    let mut want = vec![f64::NAN; rows * parts];
    for rank in p.ranks() {
        let (xr, or) = (xl.region_of(*rank).unwrap(), ol.region_of(*rank).unwrap());
        assert_eq!(or[1].len(), 1, "one column per rank");
        let k = or[1].start;
        for i in xr[0].clone() {
            let cols: Vec<f64> = xr[1]
                .clone()
                .filter(|&j| j < classes)
                .map(|j| x[i * width + j])
                .collect();
            want[i * parts + k] = lse(&cols);
        }
    }
    want
}

/// Dispatches the per-shard log-sum-exp of `x` over `classes` on every rank and checks it
/// against the reference: dtype, layout, each column, and their log-sum-exp (the row's).
fn check_partials(
    mesh: &[usize],
    sbp: NdSbp,
    rows: usize,
    width: usize,
    classes: usize,
    dtype: DType,
    seed: u64,
) {
    let p = placement(mesh, seed);
    let what = format!("{p} {sbp} [{rows}, {width}] over {classes} classes in {dtype}");
    let parts: usize = sbp
        .iter()
        .zip(p.shape())
        .filter(|(s, _)| *s == S(1))
        .map(|(_, &n)| n)
        .product();
    let x = never_zero(vals(&logits_of(Tensor::randn([rows, width], seed, dtype))));
    let want = expected_partials(&x, rows, width, classes, &p, &sbp, parts);
    let got = run_ranks(p.num_ranks(), Duration::from_secs(60), |_| {
        let xg =
            logits_of(Tensor::randn_global([rows, width], seed, dtype, &p, sbp.clone()).unwrap());
        let op = LossOp::VocabParallelLse {
            at: ClassShard { start: 0, classes },
            parts,
        };
        let y = dispatch(Op::from(op), &[&xg]).unwrap();
        let b = NdSbp::broadcast(p.ndim());
        (
            y.dtype(),
            y.nd_sbp().cloned(),
            y.shape().clone(),
            vals(&y.to_global(&p, b).unwrap()),
        )
    });
    for (rank, (dt, nd, shape, y)) in got.into_iter().enumerate() {
        assert_eq!(dt, dtype.compute(), "{what}: partials in the compute dtype");
        assert_eq!(
            nd.as_ref(),
            Some(&sbp),
            "{what}: partials in the logits' layout"
        );
        assert_eq!(shape, Shape::from([rows, parts]), "{what}");
        for (i, (g, w)) in y.iter().zip(&want).enumerate() {
            assert!(
                close(*g, *w, tolerance(dtype)),
                "{what} rank {rank} [{}, {}]: got {g}, want {w}",
                i / parts,
                i % parts
            );
        }
        for i in 0..rows {
            let row = &x[i * width..i * width + classes];
            let whole = lse(&y[i * parts..(i + 1) * parts]);
            assert!(close(whole, lse(row), tolerance(dtype)), "{what} row {i}");
        }
    }
}

/// Class-split layouts: the classes over 2, 3 and 4 ranks and over the second axis of a 2x2
/// mesh whose first splits the rows, then `more`.
fn class_splits(more: Vec<(&'static [usize], NdSbp)>) -> Vec<(&'static [usize], NdSbp)> {
    let mut layouts: Vec<(&'static [usize], NdSbp)> = vec![
        (&[2], NdSbp::new([S(1)])),
        (&[3], NdSbp::new([S(1)])),
        (&[4], NdSbp::new([S(1)])),
        (&[2, 2], NdSbp::new([S(0), S(1)])),
    ];
    layouts.extend(more);
    layouts
}

#[test]
fn per_shard_log_sum_exp_on_uneven_class_splits() {
    let layouts = class_splits(vec![
        (&[2, 2], NdSbp::new([B, S(1)])),
        (&[2, 2], NdSbp::new([S(1), S(1)])),
        (&[3, 2], NdSbp::new([S(1), S(0)])),
    ]);
    for (i, (mesh, sbp)) in layouts.into_iter().enumerate() {
        // 10 columns over 3 or 4 shards leave shards of padding only; 3 over 4 an empty one.
        for (width, classes) in [(10, 7), (10, 10), (7, 2), (3, 3), (3, 1)] {
            for dtype in [F, DType::F32, DType::BF16] {
                check_partials(mesh, sbp.clone(), 5, width, classes, dtype, i as u64 + 3);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random shapes, class counts, meshes, layouts with the classes split on at least one
    /// axis, dtypes and seeds.
    #[test]
    fn per_shard_log_sum_exp_equals_the_reference(
        rows in 1usize..7,
        width in 1usize..14,
        cut in 0usize..13,
        dtype in prop::sample::select(vec![F, DType::F32, DType::BF16]),
        mesh in prop::sample::select(vec![vec![2usize], vec![3], vec![4], vec![2, 2], vec![1, 3], vec![3, 2]]),
        codes in proptest::collection::vec(0usize..3, 2),
        seed in 0u64..1000,
    ) {
        let classes = width - cut % width;
        let mut sbp: Vec<Sbp> = mesh.iter().zip(&codes).map(|(_, &c)| [S(1), S(0), B][c]).collect();
        if !sbp.contains(&S(1)) {
            let axis = seed as usize % sbp.len();
            sbp[axis] = S(1);
        }
        check_partials(&mesh, NdSbp::new(sbp), rows, width, classes, dtype, seed);
    }
}

/// Both padded losses of class-split `dtype` logits (`sbp` on `mesh`) against the reference:
/// the classifier's loss in the compute dtype, the cross-entropy's in the logits' dtype, the
/// gradient in the logits' layout and dtype, exactly 0 in the padding.
fn check_losses(
    mesh: &[usize],
    sbp: NdSbp,
    rows: usize,
    width: usize,
    classes: usize,
    dtype: DType,
) {
    let p = placement(mesh, 5);
    let what = format!("{p} {sbp} [{rows}, {width}] over {classes} classes in {dtype}");
    let tv: Vec<i64> = (0..rows as i64)
        .map(|i| (i * 5 + 2) % classes as i64)
        .collect();
    let x = never_zero(vals(&logits_of(Tensor::randn([rows, width], 1, dtype))));
    let c = vals(&Tensor::randn([rows], 2, F));
    let (want_l, want_g) = reference(&x, width, classes, &tv, &c);
    let got = run_ranks(p.num_ranks(), Duration::from_secs(60), |_| {
        let b = NdSbp::broadcast(p.ndim());
        let t = Tensor::from_vec(tv.clone(), [rows])
            .unwrap()
            .to_global(&p, b.clone())
            .unwrap();
        let mut out = Vec::new();
        for classifier in [true, false] {
            let xg =
                logits_of(Tensor::randn_global([rows, width], 1, dtype, &p, sbp.clone()).unwrap())
                    .detach()
                    .requires_grad_(true);
            let loss = if classifier {
                classifier_loss_padded(&xg, &t, classes).unwrap()
            } else {
                xg.cross_entropy_padded(&t, classes).unwrap()
            };
            let cg = Tensor::randn_global([rows], 2, F, &p, b.clone())
                .unwrap()
                .to_dtype(loss.dtype())
                .unwrap();
            loss.mul(&cg)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let g = xg.grad().unwrap();
            let all = |t: &Tensor| vals(&t.to_global(&p, b.clone()).unwrap());
            out.push((
                loss.dtype(),
                g.dtype(),
                g.nd_sbp().cloned(),
                all(&loss),
                all(&g),
            ));
        }
        out
    });
    // bf16 losses round once more; bf16 gradients are rounded once.
    let (ltol, gtol) = match dtype {
        DType::BF16 => (2f64.powi(-7), 2f64.powi(-7)),
        d => (tolerance(d), tolerance(d)),
    };
    for (rank, runs) in got.into_iter().enumerate() {
        for (k, (ldt, gdt, g_sbp, l, g)) in runs.into_iter().enumerate() {
            let path = if k == 0 {
                "classifier_loss_padded"
            } else {
                "cross_entropy_padded"
            };
            let want_ldt = if k == 0 { dtype.compute() } else { dtype };
            assert_eq!(ldt, want_ldt, "{what} {path}: loss dtype");
            assert_eq!(gdt, dtype, "{what} {path}: gradient dtype");
            // (A partial leaf's gradient takes the layout boxing's backward gives it.)
            if !sbp.iter().any(|s| s == Sbp::P) {
                assert_eq!(g_sbp.as_ref(), Some(&sbp), "{what} {path}: gradient layout");
            }
            let lt = if k == 0 && dtype == DType::BF16 {
                tolerance(DType::F32)
            } else {
                ltol
            };
            for (i, (a, w)) in l.iter().zip(&want_l).enumerate() {
                assert!(
                    close(*a, *w, lt),
                    "{what} {path} rank {rank} loss [{i}]: {a} vs {w}"
                );
            }
            for (i, (a, w)) in g.iter().zip(&want_g).enumerate() {
                assert!(
                    close(*a, *w, gtol),
                    "{what} {path} rank {rank} dlogits [{i}]: {a} vs {w}"
                );
                if i % width >= classes {
                    assert!(
                        *a == 0.0,
                        "{what} {path} rank {rank}: padding gradient [{i}] is {a}"
                    );
                }
            }
        }
    }
}

#[test]
fn padded_losses_of_class_split_logits_equal_the_reference_in_every_dtype() {
    let layouts = class_splits(vec![
        (&[2, 2], NdSbp::new([S(1), S(1)])),
        // Partial logits are reduced onto class shards first.
        (&[2, 2], NdSbp::new([Sbp::P, S(1)])),
    ]);
    for (mesh, sbp) in layouts {
        for (width, classes) in [(10, 7), (10, 10), (9, 2), (3, 3)] {
            for dtype in [F, DType::F32, DType::BF16] {
                check_losses(mesh, sbp.clone(), 6, width, classes, dtype);
            }
            // No rows at all.
            check_losses(mesh, sbp.clone(), 0, width, classes, F);
        }
    }
}

/// On class-split logits, bad class counts and targets in the padding are the same typed
/// errors as on whole ones, on every rank.
#[test]
fn bad_input_on_class_split_logits_is_refused_alike() {
    for (mesh, sbp) in [
        (&[2usize][..], NdSbp::new([S(1)])),
        (&[2, 2][..], NdSbp::new([S(0), S(1)])),
    ] {
        let p = placement(mesh, 9);
        let got = run_ranks(p.num_ranks(), Duration::from_secs(60), |_| {
            let b = NdSbp::broadcast(p.ndim());
            let x = Tensor::randn_global([4, 9], 1, DType::BF16, &p, sbp.clone()).unwrap();
            let labels = |v: Vec<i64>| {
                Tensor::from_vec(v, [4])
                    .unwrap()
                    .to_global(&p, b.clone())
                    .unwrap()
            };
            let (t, pad) = (labels(vec![0, 1, 2, 3]), labels(vec![4; 4]));
            let mut errors = Vec::new();
            // Class counts outside 1..=9, then targets in the padding (classes 4: target 4).
            for (classes, t) in [(0, &t), (10, &t), (4, &pad)] {
                let e = classifier_loss_padded(&x, t, classes).unwrap_err();
                errors.push(e.to_string());
                let e = x.cross_entropy_padded(t, classes).unwrap_err();
                errors.push(e.to_string());
            }
            errors
        });
        for errors in got {
            for (k, e) in errors.iter().enumerate() {
                let op = ["classifier", "cross_entropy"][k % 2];
                let ok = match k / 2 {
                    c @ (0 | 1) => {
                        let classes = [0, 10][c];
                        e.contains(op)
                            && e.contains(&format!("classes {classes}"))
                            && e.contains("[4, 9]")
                    }
                    _ => e.contains("out of range"),
                };
                assert!(ok, "{mesh:?} error {k}: {e}");
            }
        }
    }
}
