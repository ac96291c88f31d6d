//! The engine's products of one to sixteen 16-bit rows on CUDA (the few-row kernels a
//! decoding step's products take) against the f64 product of the same rounded values: a
//! weight stored `[k, n]` and one used transposed (stored `[n, k]`), every row tile (1, 2, 4,
//! 8, 16 rows, and counts between them), columns that fill a block and ones that do not,
//! leading dims folded into the rows; the launch counter shows the kernels ran. Products the
//! kernels do not serve (17 rows, n or k not a multiple of 8) take cuBLAS and are checked the
//! same way. Without a CUDA device it prints that it was skipped.

mod common;

use common::{close, vals};

use oxiflow_cuda::few_row_launches;
use oxiflow_tensor::{DType, DeviceType, NdSbp, Placement, Sbp, Tensor};

/// Never-zero values in (-1.5, -0.1] U [0.1, 1.5) from `seed`.
fn values(n: usize, seed: u64) -> Vec<f64> {
    let r = Tensor::rand([n], seed, DType::F64).to_vec::<f64>().unwrap();
    r.iter()
        .enumerate()
        .map(|(i, u)| (0.1 + 1.4 * u) * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect()
}

/// `[lead.., m, k]` rows times a `[k, n]` weight (or `[n, k]` used transposed with `tb`) on
/// cuda:0 in `dt`, against the f64 product; whether the few-row kernels ran it.
fn check(dt: DType, lead: &[usize], k: usize, n: usize, tb: bool, seed: u64) -> bool {
    let p = Placement::new_1d(DeviceType::Cuda, vec![0]).unwrap();
    let b1 = NdSbp::new([Sbp::B]);
    let rows: usize = lead.iter().product();
    let mut xs = lead.to_vec();
    xs.push(k);
    let ws = if tb { vec![n, k] } else { vec![k, n] };
    let x = Tensor::from_vec(values(rows * k, seed), xs)
        .unwrap()
        .cast(dt)
        .unwrap();
    let w = Tensor::from_vec(values(k * n, seed + 1), ws)
        .unwrap()
        .cast(dt)
        .unwrap();
    let product = |x: &Tensor, w: &Tensor| {
        if tb {
            x.matmul_t(w, false, true).unwrap()
        } else {
            x.matmul(w).unwrap()
        }
    };
    let want = vals(&product(
        &x.cast(DType::F64).unwrap(),
        &w.cast(DType::F64).unwrap(),
    ));
    let before = few_row_launches();
    let got = product(
        &x.to_global(&p, b1.clone()).unwrap(),
        &w.to_global(&p, b1.clone()).unwrap(),
    );
    let ran = few_row_launches() > before;
    let what = format!("{dt} {lead:?} x {k} by {n} (transposed: {tb})");
    // One rounding of an f32 sum to 8 (bf16) or 11 (f16) bits.
    close(&vals(&got), &want, 8e-3, &what);
    ran
}

#[test]
fn few_row_products_on_cuda_match_f64() {
    let Some(_world) = common::cuda_world_or_skip("few_row_products_cuda") else {
        return;
    };
    let mut seed = 1;
    for dt in [DType::BF16, DType::F16] {
        for tb in [false, true] {
            for rows in [1usize, 2, 3, 4, 5, 8, 9, 13, 16] {
                for (k, n) in [
                    (8usize, 8usize),
                    (64, 24),
                    (264, 136),
                    (2048, 512),
                    (520, 2056),
                ] {
                    seed += 2;
                    assert!(
                        check(dt, &[rows], k, n, tb, seed),
                        "{dt} {rows} x {k} by {n} (transposed: {tb}) did not take the few-row kernels"
                    );
                }
            }
            // Leading dims folded into the rows (a decoding step's [B, 1, C]).
            assert!(check(dt, &[4, 1], 256, 64, tb, 99));
            // Served by cuBLAS: 17 rows, n or k not a multiple of 8.
            for (lead, k, n) in [
                (vec![17usize], 64usize, 64usize),
                (vec![3], 64, 12),
                (vec![3], 12, 64),
            ] {
                assert!(!check(dt, &lead, k, n, tb, 7), "{lead:?} x {k} by {n}");
            }
        }
    }
}
