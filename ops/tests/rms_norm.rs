//! Fused RMS normalisation through the public op contract: the forward and backward kernels
//! (f32, f64, bf16 on the CPU) against an f64 reference on random, never-zero data, autograd
//! through it (the weight's gradient the sum of the kernel's terms), the typed errors, and the
//! global property: any layout of the operands (uneven splits, broadcasts, partial inputs, 1-d
//! and 2-d meshes, a rank outside the placement) gives the single-rank values and gradients.

mod common;

use common::{
    assert_layouts_equal_one_rank, close, nd_sbp, placement, pointwise_layouts_equal_one_rank, vals,
};

use oxiflow_ops::rms_norm::{rms_norm, rms_norm_backward, wide};
use oxiflow_tensor::{DType, Tensor, TensorError};
use proptest::prelude::*;

const EPS: f64 = 1e-5;

/// Random values in ±[0.1, 2.1): never zero.
fn nonzero(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    let u = Tensor::randn(shape.to_vec(), seed, DType::F64);
    let v: Vec<f64> = vals(&u)
        .iter()
        .map(|&x| x.signum() * (0.1 + x.abs().min(2.0)))
        .collect();
    Tensor::from_vec(v, shape.to_vec())
        .unwrap()
        .cast(dt)
        .unwrap()
}

/// The f64 reference of (y, dx, dy * xhat) for rows of width h.
fn reference(x: &[f64], w: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let h = w.len();
    let (mut y, mut dx, mut t) = (vec![], vec![], vec![]);
    for ((xr, dr), _) in x.chunks(h).zip(dy.chunks(h)).zip(0..) {
        let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / h as f64 + EPS).sqrt();
        let proj = (0..h).map(|j| dr[j] * w[j] * xr[j] * r).sum::<f64>() / h as f64;
        for j in 0..h {
            y.push(xr[j] * r * w[j]);
            dx.push(r * (dr[j] * w[j] - xr[j] * r * proj));
            t.push(dr[j] * xr[j] * r);
        }
    }
    (y, dx, t)
}

fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F64 => 1e-12,
        DType::F32 => 2e-5,
        _ => 2e-2,
    }
}

fn check_local(rows: usize, h: usize, seed: u64, dt: DType) {
    let x = nonzero(&[rows, h], seed, dt);
    let w = nonzero(&[h], seed + 1, dt);
    let dy = nonzero(&[rows, h], seed + 2, dt);
    let y = rms_norm(&x, &w, EPS).unwrap();
    assert_eq!((y.shape(), y.dtype()), (x.shape(), dt));
    let (dx, terms) = rms_norm_backward(&x, &w, &dy, EPS).unwrap();
    assert_eq!((dx.dtype(), terms.dtype()), (dt, wide(dt)));
    let (ry, rdx, rt) = reference(&vals(&x), &vals(&w), &vals(&dy));
    let (tol, what) = (tolerance(dt), format!("{dt} [{rows}, {h}]"));
    close(&vals(&y), &ry, tol, &format!("{what} y"));
    close(&vals(&dx), &rdx, tol, &format!("{what} dx"));
    close(&vals(&terms), &rt, tol, &format!("{what} terms"));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn kernels_match_the_f64_reference(
        rows in 0usize..9,
        h in 1usize..40,
        seed in any::<u32>(),
        dt in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16]),
    ) {
        check_local(rows, h, u64::from(seed), dt);
    }
}

#[test]
fn large_arrays_run_in_parallel_chunks_alike() {
    check_local(40, 2048, 7, DType::F32);
    check_local(3, 70_001, 8, DType::BF16);
    check_local(20_000, 3, 9, DType::F64);
}

#[test]
fn autograd_gives_the_kernel_gradients() {
    let x = nonzero(&[4, 6], 1, DType::F64).requires_grad_(true);
    let w = nonzero(&[6], 2, DType::F64).requires_grad_(true);
    let r = nonzero(&[4, 6], 3, DType::F64);
    let y = rms_norm(&x, &w, EPS).unwrap();
    assert_eq!(y.grad_fn_name().as_deref(), Some("rms_norm"));
    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let (_, rdx, rt) = reference(&vals(&x), &vals(&w), &vals(&r));
    close(&vals(&x.grad().unwrap()), &rdx, 1e-12, "dx");
    let dw: Vec<f64> = (0..6).map(|j| rt.iter().skip(j).step_by(6).sum()).collect();
    close(&vals(&w.grad().unwrap()), &dw, 1e-12, "dw");
    // The weight alone: x gets no gradient.
    let x2 = nonzero(&[4, 6], 1, DType::F64);
    let w2 = nonzero(&[6], 2, DType::F64).requires_grad_(true);
    let y2 = rms_norm(&x2, &w2, EPS).unwrap();
    y2.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(x2.grad().is_none());
    close(&vals(&w2.grad().unwrap()), &dw, 1e-12, "dw alone");
    // bf16: the weight's gradient is summed in f32 and cast to the weight's dtype.
    let xb = nonzero(&[4, 6], 1, DType::BF16).requires_grad_(true);
    let wb = nonzero(&[6], 2, DType::BF16).requires_grad_(true);
    rms_norm(&xb, &wb, EPS)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(wb.grad().unwrap().dtype(), DType::BF16);
}

#[test]
fn bad_input_is_a_typed_error() {
    let x = Tensor::randn([2, 3], 1, DType::F32);
    let e = rms_norm(&x, &Tensor::randn([2], 2, DType::F32), EPS).unwrap_err();
    assert!(
        matches!(e, TensorError::Shape { op: "rms_norm", .. }),
        "{e}"
    );
    let e = rms_norm(&x, &Tensor::randn([3], 2, DType::F64), EPS).unwrap_err();
    assert!(
        matches!(e, TensorError::DType { op: "rms_norm", .. }),
        "{e}"
    );
    let e = rms_norm(&x, &Tensor::randn([3], 2, DType::F32), f64::NAN).unwrap_err();
    assert!(e.to_string().contains("eps"), "{e}");
    let e = rms_norm(&Tensor::randn([], 1, DType::F32), &x, EPS).unwrap_err();
    assert!(matches!(e, TensorError::Shape { .. }), "{e}");
    // f16 has a CUDA kernel but no CPU one.
    let h = Tensor::randn([2, 3], 1, DType::F16);
    let e = rms_norm(&h, &Tensor::randn([3], 1, DType::F16), EPS).unwrap_err();
    assert!(
        matches!(
            e,
            TensorError::NoKernel {
                op: "rms_norm",
                backend: "cpu",
                ..
            }
        ),
        "{e}"
    );
}

/// x `[rows, h]`, w `[h]` and the loss weight on `mesh` as the seeds draw them: the value
/// and gradients equal one rank's.
fn global_case(mesh: &[usize], perm: u64, extra: bool, rows: usize, h: usize, seeds: (u64, u64)) {
    let p = placement(mesh, perm);
    let nds = [
        nd_sbp(p.ndim(), 2, seeds.0, true),
        nd_sbp(p.ndim(), 1, seeds.1, true),
        nd_sbp(p.ndim(), 2, seeds.0 ^ seeds.1, false),
    ];
    let shapes = [vec![rows, h], vec![h], vec![rows, h]];
    let [x_nd, w_nd, r_nd] = &nds;
    let what = format!("{mesh:?} on {p}: x {x_nd}, w {w_nd}, r {r_nd}, [{rows}, {h}]");
    assert_layouts_equal_one_rank(
        &p,
        extra,
        &nds,
        |i| nonzero(&shapes[i], i as u64 + 1, DType::F64),
        |x, w| rms_norm(x, w, EPS).unwrap(),
        ["y", "dx", "dw"],
        &what,
    );
}

pointwise_layouts_equal_one_rank!(
    rows in 1usize..8,
    h in 1usize..7,
    seeds in (any::<u64>(), any::<u64>()),
);

#[test]
fn uneven_splits_and_partial_inputs_on_a_2d_mesh() {
    // 5 rows over 2 ranks and a partial weight on the other axis.
    global_case(&[2, 3], 0, true, 5, 7, (11, 12));
    global_case(&[3], 5, false, 7, 2, (3, 4));
}
