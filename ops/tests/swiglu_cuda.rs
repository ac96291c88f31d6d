//! SwiGLU's CUDA kernels (through the library's NVRTC path) against the CPU's f64 reference:
//! forward and backward for f32, f64, bf16 and f16, empty and large pieces, split over a
//! device placement. Without a CUDA device it prints that it was skipped.

mod common;

use common::vals;

use oxiflow_ops::swiglu::{swiglu, swiglu_backward, swiglu_pairs};
use oxiflow_tensor::{DType, Sbp, Tensor};

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn swiglu_on_cuda_matches_the_f64_reference() {
    let Some((_world, p)) = common::cuda_device_or_skip("swiglu_cuda") else {
        return;
    };
    {
        for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            for shape in [vec![0usize, 3], vec![7, 5], vec![1 << 20]] {
                let mk = |seed| Tensor::randn_global(shape.clone(), seed, dt, &p, Sbp::S(0));
                let (g, u, dy) = (mk(1).unwrap(), mk(2).unwrap(), mk(3).unwrap());
                let y = swiglu(&g, &u).unwrap();
                let (dg, du) = swiglu_backward(&g, &u, &dy).unwrap();
                let (gv, uv, dv) = (vals(&g), vals(&u), vals(&dy));
                let tol = match dt {
                    DType::F64 => 1e-12,
                    DType::F32 => 1e-5,
                    _ => 1.6e-2,
                };
                let (yv, dgv, duv) = (vals(&y), vals(&dg), vals(&du));
                for i in 0..gv.len() {
                    let (a, b, d) = (gv[i], uv[i], dv[i]);
                    let s = sigmoid(a);
                    let want = [a * s * b, d * b * s * (1.0 + a * (1.0 - s)), d * a * s];
                    for (got, w) in [yv[i], dgv[i], duv[i]].into_iter().zip(want) {
                        assert!(
                            (got - w).abs() <= tol * w.abs().max(1.0),
                            "{dt} {shape:?} element {i}: {got} vs {w}"
                        );
                    }
                }
            }
        }
    }
}

/// The packed form on the device against the CPU's f64 value of the same (rounded) inputs.
#[test]
fn swiglu_pairs_on_cuda_matches_the_f64_reference() {
    let Some((_world, p)) = common::cuda_device_or_skip("swiglu_cuda") else {
        return;
    };
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for shape in [
            vec![1usize, 1, 8192, 2],
            vec![16, 1, 8192, 2],
            vec![3, 5, 2],
            vec![0, 4, 2],
        ] {
            let x = Tensor::randn_global(shape.clone(), 4, dt, &p, Sbp::S(0)).unwrap();
            let y = swiglu_pairs(&x).unwrap();
            let (xv, yv) = (vals(&x), vals(&y));
            let tol = match dt {
                DType::F64 => 1e-12,
                DType::F32 => 1e-5,
                _ => 1.6e-2,
            };
            assert_eq!(yv.len(), xv.len() / 2);
            for (i, got) in yv.iter().enumerate() {
                let (a, b) = (xv[2 * i], xv[2 * i + 1]);
                let want = a * sigmoid(a) * b;
                assert!(
                    (got - want).abs() <= tol * want.abs().max(1.0),
                    "{dt} {shape:?} element {i}: {got} vs {want}"
                );
            }
        }
    }
}
