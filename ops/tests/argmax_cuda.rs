//! The arg-max's CUDA kernel (through the library's NVRTC path) against the host scan: rows
//! with ties, NaN and infinities, a vocabulary-wide row, many rows, every float dtype, split
//! over a device placement. Without a CUDA device it prints that it was skipped.

mod common;

use common::first_largest;

use oxiflow_ops::argmax::argmax;
use oxiflow_tensor::{DType, NdSbp, Sbp, Tensor};

#[test]
fn argmax_on_cuda_matches_the_host_scan() {
    let Some((_world, p)) = common::cuda_device_or_skip("argmax_cuda") else {
        return;
    };
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (rows, n, seed) in [
            (5usize, 7usize, 1u64),
            (16, 128_256, 2),
            (4096, 33, 3),
            (1, 1, 4),
            (3, 1000, 5),
            (2, 4100, 6),
        ] {
            let r = Tensor::randn([rows * n], seed, DType::F64);
            let mut v: Vec<f64> = r
                .to_vec::<f64>()
                .unwrap()
                .iter()
                .map(|e| (e * 4.0).round() / 4.0)
                .collect();
            // Specials in the first rows: NaN first, -inf, +inf late, an all-NaN row.
            if n >= 4 {
                v[0] = f64::NAN;
                v[1] = f64::NEG_INFINITY;
                if rows > 1 {
                    v[n + n - 1] = f64::INFINITY;
                }
            }
            if rows > 2 {
                v[2 * n..3 * n].iter_mut().for_each(|e| *e = f64::NAN);
            }
            let host = Tensor::from_vec(v.clone(), [rows, n])
                .unwrap()
                .cast(dt)
                .unwrap();
            let rounded = host.cast(DType::F64).unwrap().to_vec::<f64>().unwrap();
            let x = host
                .to_global(&p, NdSbp::broadcast(1))
                .unwrap()
                .to_global(&p, NdSbp::new([Sbp::S(0)]))
                .unwrap();
            let got: Vec<i64> = argmax(&x).unwrap().to_vec::<i64>().unwrap();
            let want: Vec<i64> = rounded.chunks(n).map(first_largest).collect();
            assert_eq!(got, want, "{dt} [{rows}, {n}]");
        }
    }
}
