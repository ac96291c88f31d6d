//! Padded classes: the fused classifier (`classifier_loss_padded`) and the cross-entropy
//! (`cross_entropy_padded`, whose class-split logits take the vocabulary-parallel path) over the
//! first `classes` columns of wider logits, against an f64 reference computed here: loss and
//! gradient in f64, f32, bf16 and f16, on local tensors and on global layouts (rows uneven over
//! ranks, classes split unevenly with shards holding only padding, 1-d and 2-d meshes), the
//! padded columns' gradient exactly 0, and typed errors for bad class counts and for targets
//! in the padding.

mod common;

use std::time::Duration;

use common::{
    nd_sbp, padded_cross_entropy_reference as reference, placement, saved_count, small_meshes, vals,
};
use oxiflow_ops::classifier::{classifier_loss, classifier_loss_padded};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Placement, Sbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

fn targets(rows: usize, classes: usize, seed: u64) -> Vec<i64> {
    (0..rows as u64)
        .map(|i| ((i * 7 + seed * 13) % classes as u64) as i64)
        .collect()
}

/// The largest relative rounding of `dtype` (f64: a few f64 ulps).
fn roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        DType::F32 => 2f64.powi(-24),
        _ => 2f64.powi(-50),
    }
}

/// `got` within `ulps` roundings of `dtype` of `want` (plus f32 error for 16-bit and f32
/// data, computed in f32); the first mismatch otherwise.
fn within(got: &[f64], want: &[f64], dtype: DType, ulps: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} values, want {}", got.len(), want.len()));
    }
    let f32_err = if dtype == F { 1e-12 } else { 1e-5 };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = ulps * roundoff(dtype) * w.abs() + f32_err * (1.0 + w.abs());
        if (g - w).abs() > tol || g.is_nan() {
            return Err(format!("[{i}]: got {g}, want {w} (tolerance {tol:.2e})"));
        }
    }
    Ok(())
}

/// Whether every padded column (from `classes` on) of `grad` `[rows, width]` is exactly 0.
fn padding_is_zero(grad: &[f64], width: usize, classes: usize) -> Result<(), String> {
    for (i, row) in grad.chunks(width).enumerate() {
        if let Some(j) = (classes..width).find(|&j| row[j] != 0.0) {
            return Err(format!(
                "row {i} column {j}: gradient {} in the padding",
                row[j]
            ));
        }
    }
    Ok(())
}

/// The dtype of the classifier's loss (and of the incoming gradient) for `dtype` logits.
fn loss_dtype(dtype: DType) -> DType {
    if dtype == F {
        F
    } else {
        DType::F32
    }
}

/// Loss and the logits' gradient of `sum(loss * c)` through `f`.
fn loss_and_grad(
    x: &Tensor,
    c: &Tensor,
    f: impl Fn(&Tensor) -> oxiflow_tensor::Result<Tensor>,
) -> (Tensor, Tensor) {
    let x = x.detach().requires_grad_(true);
    let loss = f(&x).unwrap();
    loss.mul(c).unwrap().sum_all().unwrap().backward().unwrap();
    (loss, x.grad().unwrap())
}

#[test]
fn padded_classifier_equals_the_f64_reference_in_every_float_dtype() {
    for dt in [F, DType::F32, DType::BF16, DType::F16] {
        for (rows, width, classes) in [(6, 16, 11), (5, 9, 1), (4, 7, 7), (3, 64, 50), (1, 3, 2)] {
            let what = format!("{dt} [{rows}, {width}] over {classes} classes");
            let x = Tensor::randn([rows, width], 1, F)
                .mul_scalar(3.0)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let tv = targets(rows, classes, 2);
            let t = Tensor::from_vec(tv.clone(), [rows]).unwrap();
            let c = Tensor::randn([rows], 3, F)
                .to_dtype(loss_dtype(dt))
                .unwrap();
            let (l, g) = loss_and_grad(&x, &c, |x| classifier_loss_padded(x, &t, classes));
            assert_eq!((l.dtype(), g.dtype()), (loss_dtype(dt), dt), "{what}");
            let (wl, wg) = reference(&vals(&x), width, classes, &tv, &vals(&c));
            let (gl, gg) = (vals(&l), vals(&g));
            within(&gl, &wl, dt, 2.0).unwrap_or_else(|e| panic!("{what} loss {e}"));
            // Rounded once in the forward and once in the row scaling.
            within(&gg, &wg, dt, 3.0).unwrap_or_else(|e| panic!("{what} gradient {e}"));
            padding_is_zero(&gg, width, classes).unwrap_or_else(|e| panic!("{what}: {e}"));
        }
    }
}

#[test]
fn padding_changes_nothing_that_counts() {
    // The padded classifier on [N, V + pad] equals the unpadded one on the first V columns,
    // whatever the padding holds (huge values included), bit for bit on the CPU.
    let (rows, v, pad) = (5, 9, 7);
    let x = Tensor::randn([rows, v], 4, F);
    let junk = Tensor::randn([rows, pad], 5, F).mul_scalar(1e6).unwrap();
    let wide = Tensor::concat(&[&x, &junk], 1).unwrap();
    let t = Tensor::from_vec(targets(rows, v, 1), [rows]).unwrap();
    let c = Tensor::randn([rows], 6, F);
    let (l0, g0) = loss_and_grad(&x, &c, |x| classifier_loss(x, &t));
    let (l1, g1) = loss_and_grad(&wide, &c, |x| classifier_loss_padded(x, &t, v));
    assert_eq!(vals(&l0), vals(&l1));
    let g1 = vals(&g1);
    let real: Vec<f64> = g1.chunks(v + pad).flat_map(|r| r[..v].to_vec()).collect();
    assert_eq!(vals(&g0), real);
    padding_is_zero(&g1, v + pad, v).unwrap();
    // classes == width is the unpadded classifier; the cross-entropy likewise.
    let (l2, _) = loss_and_grad(&x, &c, |x| classifier_loss_padded(x, &t, v));
    assert_eq!(vals(&l0), vals(&l2));
    let (l3, g3) = loss_and_grad(&wide, &c, |x| x.cross_entropy_padded(&t, v));
    within(&vals(&l3), &vals(&l0), F, 4.0).unwrap();
    padding_is_zero(&vals(&g3), v + pad, v).unwrap();
}

#[test]
fn padded_classifier_keeps_only_the_logits_gradient() {
    let x = Tensor::randn([4, 16], 1, F).requires_grad_(true);
    let t = Tensor::from_vec(targets(4, 9, 1), [4]).unwrap();
    let loss = classifier_loss_padded(&x, &t, 9).unwrap();
    assert_eq!(saved_count(&loss), Some(1));
}

#[test]
fn bad_class_counts_and_targets_in_the_padding_are_typed_errors() {
    let x = Tensor::randn([4, 9], 1, F);
    let t = Tensor::from_vec(targets(4, 5, 1), [4]).unwrap();
    for classes in [0, 10] {
        let e = classifier_loss_padded(&x, &t, classes)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("classifier")
                && e.contains(&format!("classes {classes}"))
                && e.contains("[4, 9]"),
            "{e}"
        );
        let e = x.cross_entropy_padded(&t, classes).unwrap_err().to_string();
        assert!(
            e.contains("cross_entropy") && e.contains(&format!("classes {classes}")),
            "{e}"
        );
    }
    let e = Tensor::randn([9], 1, F)
        .cross_entropy_padded(&t, 3)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cross_entropy") && e.contains("[N, C]"), "{e}");
    // A target in the padding (5..9 of 9 columns with 5 classes) is out of range.
    let bad = Tensor::from_vec(vec![0i64, 5, 1, 2], [4]).unwrap();
    let e = classifier_loss_padded(&x, &bad, 5).unwrap_err().to_string();
    assert!(e.contains("5") && e.contains("range"), "{e}");
    let e = x.cross_entropy_padded(&bad, 5).unwrap_err().to_string();
    assert!(e.contains("5") && e.contains("range"), "{e}");
}

/// Logits of `dtype` `[rows, width]` (seed 1, times 3) made as `mk` says.
fn logits_of(x: Tensor) -> Tensor {
    x.mul_scalar(3.0).unwrap()
}

/// `cross_entropy_padded` of class-split (and other) layouts against the reference: value,
/// gradient (exact zeros in the padding, in the logits' layout), and a target in the padding
/// refused on every rank.
fn check_cross_entropy(p: &Placement, x_sbp: NdSbp, rows: usize, width: usize, classes: usize) {
    let what = format!("{p} logits {x_sbp} [{rows}, {width}] over {classes} classes");
    let tv = targets(rows, classes, 3);
    let xl = logits_of(Tensor::randn([rows, width], 1, F));
    let c = Tensor::randn([rows], 2, F);
    let (want_l, want_g) = reference(&vals(&xl), width, classes, &tv, &vals(&c));
    let got = run_ranks(p.num_ranks(), Duration::from_secs(60), |_| {
        let b = NdSbp::broadcast(p.ndim());
        let x = logits_of(Tensor::randn_global([rows, width], 1, F, p, x_sbp.clone()).unwrap())
            .detach()
            .requires_grad_(true);
        let t = Tensor::from_vec(tv.clone(), [rows])
            .unwrap()
            .to_global(p, b.clone())
            .unwrap();
        let c = Tensor::randn_global([rows], 2, F, p, b.clone()).unwrap();
        let bad = Tensor::from_vec(vec![classes as i64; rows], [rows])
            .unwrap()
            .to_global(p, b.clone())
            .unwrap();
        let err = x
            .cross_entropy_padded(&bad, classes)
            .map(|_| ())
            .unwrap_err();
        let loss = x.cross_entropy_padded(&t, classes).unwrap();
        loss.mul(&c).unwrap().sum_all().unwrap().backward().unwrap();
        let g = x.grad().unwrap();
        let all = |t: &Tensor| vals(&t.to_global(p, b.clone()).unwrap());
        (err.to_string(), g.nd_sbp().cloned(), all(&loss), all(&g))
    });
    for (rank, (err, g_sbp, l, g)) in got.into_iter().enumerate() {
        assert!(err.contains("out of range"), "{what} rank {rank}: {err}");
        assert_eq!(
            g_sbp.as_ref(),
            Some(&x_sbp),
            "{what}: dlogits keep the layout"
        );
        within(&l, &want_l, F, 16.0).unwrap_or_else(|e| panic!("{what} rank {rank} loss {e}"));
        within(&g, &want_g, F, 16.0).unwrap_or_else(|e| panic!("{what} rank {rank} dlogits {e}"));
        padding_is_zero(&g, width, classes).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

#[test]
fn padded_cross_entropy_on_class_splits_equals_the_reference() {
    #[allow(non_snake_case)]
    fn S(d: usize) -> Sbp {
        Sbp::S(d)
    }
    const B: Sbp = Sbp::B;
    let layouts: [(&[usize], NdSbp); 7] = [
        (&[2], NdSbp::new([S(1)])),
        (&[3], NdSbp::new([S(1)])),
        (&[4], NdSbp::new([S(1)])),
        (&[2, 2], NdSbp::new([S(0), S(1)])),
        (&[2, 2], NdSbp::new([B, S(1)])),
        // Classes whole: the narrowed path.
        (&[3], NdSbp::new([S(0)])),
        (&[2], NdSbp::new([B])),
    ];
    for (i, (mesh, x_sbp)) in layouts.into_iter().enumerate() {
        let p = placement(mesh, i as u64);
        // 10 columns over 3 or 4 ranks leave shards of padding only (7..10, 8..10).
        for (width, classes) in [(10, 7), (8, 5), (6, 6), (5, 1)] {
            check_cross_entropy(&p, x_sbp.clone(), 5, width, classes);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Logits in random layouts (S on either dim, B, P) and dtypes, targets split or whole:
    /// the padded classifier's loss and gradient equal the reference on the same values, and
    /// the padding's gradient is exactly 0, on every rank.
    #[test]
    fn padded_classifier_on_global_layouts_equals_the_reference(
        rows in 1usize..9,
        width in 2usize..13,
        cut in 0usize..12,
        dtype in prop::sample::select(vec![F, DType::F32, DType::BF16, DType::F16]),
        mesh in small_meshes(),
        seeds in proptest::collection::vec(any::<u64>(), 4),
    ) {
        let classes = width - cut % width;
        let tv = targets(rows, classes, seeds[3] % 5);
        let xl = logits_of(Tensor::randn([rows, width], 1, dtype));
        let c = Tensor::randn([rows], 2, loss_dtype(dtype));
        let (want_l, want_g) = reference(&vals(&xl), width, classes, &tv, &vals(&c));
        let p = placement(&mesh, seeds[0]);
        let got = run_ranks(p.num_ranks(), Duration::from_secs(60), |_| {
            let b = NdSbp::broadcast(p.ndim());
            let x = Tensor::randn_global([rows, width], 1, dtype, &p, nd_sbp(p.ndim(), 2, seeds[1], true))
                .unwrap();
            let x = logits_of(x);
            let c = Tensor::randn_global([rows], 2, loss_dtype(dtype), &p, nd_sbp(p.ndim(), 1, seeds[2], true))
                .unwrap();
            let t = Tensor::from_vec(tv.clone(), [rows])
                .unwrap()
                .to_global(&p, b.clone())
                .unwrap()
                .to_global(&p, nd_sbp(p.ndim(), 1, seeds[3], false))
                .unwrap();
            let (l, g) = loss_and_grad(&x, &c, |x| classifier_loss_padded(x, &t, classes));
            let all = |t: &Tensor| vals(&t.to_global(&p, b.clone()).unwrap());
            (all(&l), all(&g))
        });
        for (rank, (l, g)) in got.iter().enumerate() {
            let checks = [
                within(l, &want_l, dtype, 2.0).map_err(|e| format!("loss {e}")),
                within(g, &want_g, dtype, 3.0).map_err(|e| format!("gradient {e}")),
                padding_is_zero(g, width, classes),
            ];
            for r in checks {
                prop_assert!(r.is_ok(), "rank {rank} {dtype} {classes} of {width}: {r:?}");
            }
        }
    }
}
