//! The fused linear cross-entropy (`linear_classifier_loss_sum`: the head's product and the
//! classifier in one op that keeps no logits) against an f64 reference of the loss and both
//! gradients, on random never-zero data in f64, f32 and bf16: one rank, rows split unevenly
//! over 1-d and 2-d meshes (empty shards included), rows whole, padding classes, no rows at
//! all; a table split on the classes (the vocabulary-parallel fallback), a call without
//! gradients (the unfused fallback), and bad input refused alike on every path.

mod common;

use std::time::Duration;

use common::{linear_cross_entropy_reference as expected, placement, vals};
use oxiflow_ops::linear_classifier::linear_classifier_loss_sum;
use oxiflow_tensor::{no_grad, run_ranks, DType, NdSbp, Sbp, Shape, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;
const B: Sbp = Sbp::B;

/// Targets below `classes`, the same on every rank.
fn targets(rows: usize, classes: usize) -> Vec<i64> {
    (0..rows as i64)
        .map(|i| (i * 5 + 2) % classes as i64)
        .collect()
}

/// Relative tolerance of `dtype`'s products (bf16 data rounds the gradients and inputs).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 1e-4,
        _ => 2f64.powi(-5),
    }
}

/// `got` against `want`, every element within `tol` of the largest magnitude.
fn assert_near(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1.0f64, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what} [{i}]: got {g}, want {w} (scale {scale})"
        );
    }
}

/// How the head is called in one check.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// With gradients: the fused op (or the vocabulary-parallel fallback for a split table).
    Grad,
    /// Under `no_grad`: the product and the classifier.
    NoGrad,
}

/// Runs the head on `mesh` with x rows laid out by `x_sbp` and the table by `w_sbp`, in
/// `dtype`, and checks the loss (times `c`) and both gradients against the f64 reference.
#[allow(clippy::too_many_arguments)]
fn check(
    mesh: &[usize],
    x_sbp: NdSbp,
    w_sbp: NdSbp,
    (rows, width, v): (usize, usize, usize),
    classes: usize,
    dtype: DType,
    path: Path,
    seed: u64,
) {
    let p = placement(mesh, seed);
    let what = format!(
        "{p} x {x_sbp} table {w_sbp} [{rows}, {width}] x [{v}, {width}] over {classes} classes in {dtype} ({path:?})"
    );
    let x = vals(&Tensor::randn([rows, width], seed, dtype));
    let w = vals(&Tensor::randn([v, width], seed + 1, dtype));
    assert!(
        x.iter().chain(&w).all(|&a| a != 0.0),
        "{what}: a zero input"
    );
    let c = 0.75;
    let tv = targets(rows, classes);
    let (want_l, want_dx, want_dw) = expected(&x, &w, (rows, width, v), classes, &tv, c);
    let got = run_ranks(p.num_ranks(), Duration::from_secs(60), |_| {
        let b = NdSbp::broadcast(p.ndim());
        let xg = Tensor::randn_global([rows, width], seed, dtype, &p, x_sbp.clone())
            .unwrap()
            .requires_grad_(true);
        let wg = Tensor::randn_global([v, width], seed + 1, dtype, &p, w_sbp.clone())
            .unwrap()
            .requires_grad_(true);
        let t = Tensor::from_vec(tv.clone(), [rows])
            .unwrap()
            .to_global(&p, b.clone())
            .unwrap()
            .to_global(&p, x_sbp.clone())
            .unwrap();
        let all = |t: &Tensor| vals(&t.to_global(&p, b.clone()).unwrap());
        match path {
            Path::Grad => {
                let loss = linear_classifier_loss_sum(&xg, &wg, &t, classes).unwrap();
                let scaled = loss.mul_scalar(c).unwrap();
                scaled.backward().unwrap();
                let (gx, gw) = (xg.grad().unwrap(), wg.grad().unwrap());
                assert_eq!(gx.dtype(), dtype, "{what}: dx dtype");
                assert_eq!(gw.dtype(), dtype, "{what}: dw dtype");
                (loss.dtype(), all(&scaled), Some((all(&gx), all(&gw))))
            }
            Path::NoGrad => {
                let _ng = no_grad();
                let loss = linear_classifier_loss_sum(&xg, &wg, &t, classes).unwrap();
                (loss.dtype(), all(&loss.mul_scalar(c).unwrap()), None)
            }
        }
    });
    let tol = tolerance(dtype);
    for (rank, (ldt, l, grads)) in got.into_iter().enumerate() {
        assert_eq!(ldt, dtype.compute(), "{what}: loss dtype");
        assert_eq!(l.len(), 1, "{what}: a 0-d loss");
        // 16-bit logits are rounded before the softmax.
        let ltol = match dtype {
            F => 1e-10,
            DType::F32 => 1e-4,
            _ => 2f64.powi(-6),
        };
        assert!(
            (l[0] - want_l).abs() <= ltol * (1.0 + want_l.abs()),
            "{what} rank {rank}: loss {} vs {want_l}",
            l[0]
        );
        if let Some((gx, gw)) = grads {
            assert_near(&gx, &want_dx, tol, &format!("{what} rank {rank} dx"));
            assert_near(&gw, &want_dw, tol, &format!("{what} rank {rank} dw"));
            for (i, g) in gw.iter().enumerate() {
                if i / width >= classes {
                    assert_eq!(*g, 0.0, "{what} rank {rank}: padding row's gradient [{i}]");
                }
            }
        }
    }
}

fn s(v: &[Sbp]) -> NdSbp {
    NdSbp::new(v.iter().copied())
}

#[test]
fn fused_head_on_rows_split_unevenly_and_whole() {
    let layouts: [(&[usize], NdSbp); 7] = [
        (&[1], s(&[B])),
        (&[2], s(&[Sbp::S(0)])),
        (&[3], s(&[Sbp::S(0)])),
        (&[2], s(&[B])),
        (&[2, 2], s(&[Sbp::S(0), B])),
        (&[2, 2], s(&[B, Sbp::S(0)])),
        (&[2, 3], s(&[Sbp::S(0), Sbp::S(0)])),
    ];
    for (i, (mesh, x_sbp)) in layouts.into_iter().enumerate() {
        let w_sbp = NdSbp::broadcast(mesh.len());
        // 5 rows over 6 ranks leaves empty shards; 9 classes of 11 leave padding rows.
        for (rows, width, v, classes) in [(5, 4, 11, 9), (7, 3, 6, 6), (2, 5, 3, 1)] {
            for dtype in [F, DType::F32, DType::BF16] {
                let seed = i as u64 * 7 + 1;
                check(
                    mesh,
                    x_sbp.clone(),
                    w_sbp.clone(),
                    (rows, width, v),
                    classes,
                    dtype,
                    Path::Grad,
                    seed,
                );
            }
        }
    }
}

/// One fused-head case on the ranks: the mesh, the layouts of x and the table, (rows, width,
/// padded vocabulary), the real classes, the path and the seed.
type Case = (
    &'static [usize],
    NdSbp,
    NdSbp,
    (usize, usize, usize),
    usize,
    Path,
    u64,
);

/// Runs every case of `cases` in each float dtype.
fn check_in_every_dtype(cases: &[Case]) {
    for dtype in [F, DType::F32, DType::BF16] {
        for (mesh, x_sbp, w_sbp, dims, classes, path, seed) in cases.iter().cloned() {
            check(mesh, x_sbp, w_sbp, dims, classes, dtype, path, seed);
        }
    }
}

#[test]
fn no_rows_give_a_zero_loss_and_zero_gradients() {
    check_in_every_dtype(&[
        (&[1], s(&[B]), s(&[B]), (0, 3, 4), 4, Path::Grad, 3),
        (&[2], s(&[Sbp::S(0)]), s(&[B]), (0, 3, 4), 2, Path::Grad, 4),
    ]);
}

#[test]
fn split_table_and_no_gradient_take_the_unfused_paths() {
    check_in_every_dtype(&[
        // The table split on the classes: the vocabulary-parallel cross-entropy.
        (&[2], s(&[B]), s(&[Sbp::S(0)]), (5, 4, 11), 9, Path::Grad, 5),
        (
            &[2, 2],
            s(&[Sbp::S(0), B]),
            s(&[B, Sbp::S(0)]),
            (6, 3, 7),
            7,
            Path::Grad,
            6,
        ),
        (
            &[2],
            s(&[Sbp::S(0)]),
            s(&[B]),
            (5, 4, 11),
            9,
            Path::NoGrad,
            7,
        ),
    ]);
}

#[test]
fn bad_input_is_refused_on_every_path() {
    let x = Tensor::randn([4, 3], 1, F).requires_grad_(true);
    let w = Tensor::randn([6, 3], 2, F).requires_grad_(true);
    let t = Tensor::from_vec(vec![0i64, 1, 2, 3], [4]).unwrap();
    for grad in [true, false] {
        let run = |x: &Tensor, w: &Tensor, t: &Tensor, classes: usize| {
            if grad {
                linear_classifier_loss_sum(x, w, t, classes)
            } else {
                let _ng = no_grad();
                linear_classifier_loss_sum(x, w, t, classes)
            }
        };
        let e = run(&x, &w, &t, 7).unwrap_err().to_string();
        assert!(
            e.contains("linear_classifier") && e.contains("classes 7"),
            "{e}"
        );
        let narrow = Tensor::randn([6, 2], 2, F);
        let e = run(&x, &narrow, &t, 6).unwrap_err().to_string();
        assert!(e.contains("[6, 2]"), "{e}");
        let tf = Tensor::from_vec(vec![0.0f64, 1.0, 2.0, 3.0], [4]).unwrap();
        assert!(run(&x, &w, &tf, 6).is_err());
        let short = Tensor::from_vec(vec![0i64, 1], [2]).unwrap();
        assert!(run(&x, &w, &short, 6).is_err());
        let wf = Tensor::randn([6, 3], 2, DType::F32);
        assert!(run(&x, &wf, &t, 6).is_err());
        // A target at or above `classes` is out of range (a typed error on the CPU).
        let far = Tensor::from_vec(vec![0i64, 1, 5, 3], [4]).unwrap();
        assert!(run(&x, &w, &far, 5).is_err());
    }
    assert_eq!(Shape::scalar().numel(), 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random shapes, class counts, meshes, row layouts, dtypes and seeds.
    #[test]
    fn fused_head_equals_the_reference(
        rows in 0usize..8,
        width in 1usize..6,
        v in 1usize..10,
        cut in 0usize..9,
        dtype in prop::sample::select(vec![F, DType::F32, DType::BF16]),
        mesh in prop::sample::select(vec![vec![1usize], vec![2], vec![3], vec![2, 2], vec![3, 2]]),
        codes in proptest::collection::vec(0usize..2, 2),
        seed in 0u64..1000,
    ) {
        let classes = v - cut % v;
        let x_sbp = NdSbp::new(mesh.iter().zip(&codes).map(|(_, &c)| [Sbp::S(0), B][c]));
        let w_sbp = NdSbp::broadcast(mesh.len());
        check(&mesh, x_sbp, w_sbp, (rows, width, v), classes, dtype, Path::Grad, seed);
    }
}
