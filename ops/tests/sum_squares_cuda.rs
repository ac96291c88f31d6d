//! The multi-tensor sum of squares on a device against f64 sums of the same values (every
//! float dtype, a million elements, empty and split pieces, hundreds of tensors in one op,
//! the `x * 0` flags), bit-equal on a second run; on CUDA when a device is visible (else it
//! says it was skipped), and the same cases on 2 in-process CPU ranks.

mod common;

use std::time::Duration;

use oxiflow_ops::sum_squares::{non_finite_sums, sum_squares_multi, TensorSums};
use oxiflow_tensor::{run_ranks, DType, DeviceType, Placement, Result, Sbp, Tensor};

/// The bits of `t`'s values (every NaN as one NaN).
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.cast(DType::F64)?
        .to_vec::<f64>()?
        .iter()
        .map(|v| if v.is_nan() { f64::NAN } else { *v }.to_bits())
        .collect())
}

/// The f64 sum of `t`'s squares, each rounded to f32 (f64 for f64 data), from its values.
fn host_sum(t: &Tensor) -> Result<f64> {
    let wide = t.dtype() == DType::F64;
    let v = t.cast(DType::F64)?.to_vec::<f64>()?;
    Ok(v.iter()
        .map(|&x| {
            if wide {
                x * x
            } else {
                f64::from((x as f32) * (x as f32))
            }
        })
        .sum())
}

/// Sums of random never-zero data on `world` ranks of `device`, split and broadcast, within
/// 1e-10 of the host's f64 sums; returns how many tensors were checked.
fn sums_on(world: usize, device: DeviceType) -> std::result::Result<usize, String> {
    let e = |what: &str, err: oxiflow_tensor::TensorError| format!("sum of squares: {what}: {err}");
    let pl =
        Placement::new_1d(device, (0..world).collect::<Vec<_>>()).map_err(|x| x.to_string())?;
    let dtypes = [DType::F32, DType::BF16, DType::F16, DType::F64];
    let mut shapes: Vec<Vec<usize>> = vec![vec![1_000_003], vec![0, 5], vec![3], vec![65, 129]];
    shapes.extend((0..300).map(|i| vec![1 + (i * 37) % 701]));
    let mut checked = 0;
    for (split, sbp) in [(false, Sbp::B), (true, Sbp::S(0))] {
        let ts: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                // |x| + 0.25 with alternating signs, scaled into each dtype's range.
                let x = Tensor::randn_global(s.clone(), 70 + i as u64, DType::F32, &pl, sbp)?
                    .abs()?
                    .add_scalar(0.25)?
                    .mul_scalar(if i % 2 == 0 { 1.5 } else { -0.75 })?;
                x.cast(dtypes[i % 4])
            })
            .collect::<Result<_>>()
            .map_err(|x| e("inputs", x))?;
        let refs: Vec<&Tensor> = ts.iter().collect();
        let TensorSums { each, total } = sum_squares_multi(&refs).map_err(|x| e("op", x))?;
        let want: Vec<f64> = ts
            .iter()
            .map(host_sum)
            .collect::<Result<_>>()
            .map_err(|x| e("host sums", x))?;
        let got = each.to_vec::<f64>().map_err(|x| e("read", x))?;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if (g - w).abs() > 1e-10 * w.abs() || (*w == 0.0) != (*g == 0.0) {
                return Err(format!(
                    "sum of squares (split {split}): tensor {i} {} {:?}: {g} vs the f64 sum {w}",
                    ts[i].dtype(),
                    shapes[i]
                ));
            }
        }
        let t = total.to_vec::<f64>().map_err(|x| e("total", x))?[0];
        let w: f64 = want.iter().sum();
        if (t - w).abs() > 1e-10 * w {
            return Err(format!("sum of squares (split {split}): total {t} vs {w}"));
        }
        let again = sum_squares_multi(&refs).map_err(|x| e("again", x))?;
        if bits(&again.total).map_err(|x| e("again", x))? != vec![t.to_bits()] {
            return Err(format!(
                "sum of squares (split {split}): a second run differs"
            ));
        }
        checked += ts.len();
    }
    // x * 0 flags: an infinity and a NaN among finite tensors.
    let v = vec![1.0f32, f32::INFINITY, 2.0, f32::NAN];
    let bad = Tensor::from_vec(v, [4])
        .and_then(|t| t.to_global(&pl, Sbp::B))
        .map_err(|x| e("flags", x))?;
    let parts: Vec<Tensor> = (0..4)
        .map(|k| bad.narrow(0, k, 1).and_then(|t| t.cast(dtypes[k])))
        .collect::<Result<_>>()
        .map_err(|x| e("flags", x))?;
    let refs: Vec<&Tensor> = parts.iter().collect();
    let flags = non_finite_sums(&refs)
        .and_then(|s| s.each.to_vec::<f64>())
        .map_err(|x| e("flags", x))?;
    if !(flags[0] == 0.0 && flags[1].is_nan() && flags[2] == 0.0 && flags[3].is_nan()) {
        return Err(format!("non-finite flags {flags:?}"));
    }
    Ok(checked)
}

#[test]
fn sums_of_squares_on_cuda() {
    let Some(_world) = common::cuda_world_or_skip("sum_squares_cuda") else {
        return;
    };
    let got = sums_on(1, DeviceType::Cuda);
    assert!(got.as_ref().is_ok_and(|&n| n > 600), "{got:?}");
}

#[test]
fn the_same_cases_on_cpu_ranks() {
    let got = run_ranks(2, Duration::from_secs(300), |_| sums_on(2, DeviceType::Cpu));
    assert!(
        got.iter().all(|r| r.as_ref().is_ok_and(|&n| n > 600)),
        "{got:?}"
    );
}
