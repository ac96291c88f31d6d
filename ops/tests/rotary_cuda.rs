//! The rotary embedding's CUDA kernel against the CPU's f64 value of the same (rounded) values:
//! the rotation and its transposed rotation (x's gradient) for f32, f64, bf16 and f16, over
//! rows a context-parallel rank holds (tables of any positions), heads 64 and 128 wide and
//! 2 wide. Without a CUDA device it prints that it was skipped.

mod common;

use common::{close, never_zero, vals};

use oxiflow_ops::rotary::rotary_tables;
use oxiflow_tensor::{DType, NdSbp, Tensor};

/// y and x's gradient of `sum(rotary(x) * w)`.
fn outcome(x: &Tensor, c: &Tensor, s: &Tensor, w: &Tensor) -> [Vec<f64>; 2] {
    let x = x.detach().requires_grad_(true);
    let y = rotary_tables(&x, c, s).unwrap();
    y.mul(w).unwrap().sum_all().unwrap().backward().unwrap();
    [vals(&y), vals(&x.grad().unwrap())]
}

#[test]
fn rotary_tables_on_cuda_match_the_cpu_in_f64() {
    let Some((_world, p)) = common::cuda_device_or_skip("rotary_cuda") else {
        return;
    };
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (b, t, h, d) in [
            (2usize, 9usize, 4usize, 64usize),
            (1, 300, 2, 128),
            (3, 5, 3, 2),
        ] {
            let host = |shape: Vec<usize>, seed: u64| {
                let n = shape.iter().product();
                Tensor::from_vec(never_zero(n, seed), shape)
                    .unwrap()
                    .cast(dt)
                    .unwrap()
            };
            let (x, c, s, w) = (
                host(vec![b, t, h, d], 1),
                host(vec![t, 1, d], 2),
                host(vec![t, 1, d], 3),
                host(vec![b, t, h, d], 4),
            );
            let wide = |t: &Tensor| t.cast(DType::F64).unwrap();
            let want = outcome(&wide(&x), &wide(&c), &wide(&s), &wide(&w));
            let on = |t: &Tensor| t.to_global(&p, NdSbp::broadcast(1)).unwrap();
            let got = outcome(&on(&x), &on(&c), &on(&s), &on(&w));
            let tol = match dt {
                DType::F64 => 1e-12,
                DType::F32 => 1e-5,
                _ => 2e-2,
            };
            let what = format!("{dt} [{b}, {t}, {h}, {d}]");
            close(&got[0], &want[0], tol, &format!("y, {what}"));
            close(&got[1], &want[1], tol, &format!("dx, {what}"));
        }
    }
}
