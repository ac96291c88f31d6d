//! Sums over large pieces (the multi-pass paths: a whole piece of a million elements, a few
//! columns of many rows, bias-gradient shapes) against f64 sums of the same values, and sums,
//! means and maxima over a short run of middle dims (the top-k routes of `[tokens, k, width]`,
//! read in place) against the host's.

use super::*;

/// Sums of random (never zero) data, broadcast over `world` ranks of `device`, over the shapes whose reductions take several
/// passes, each within 2e-4 of the f64 sum (the host sums a million f32 values in order); returns how many were checked.
pub(crate) fn child_large_reductions(world: usize, device: DeviceType) -> Checked {
    let e = |what: String, err: oxiflow_tensor::TensorError| format!("{what}: {err}");
    let pl =
        Placement::new_1d(device, (0..world).collect::<Vec<_>>()).map_err(|x| x.to_string())?;
    let mut checked = 0;
    // (shape, dims summed): the whole piece; one column; a few columns; a bias gradient.
    let cases: [(&[usize], &[isize]); 5] = [
        (&[1_000_003], &[0]),
        (&[65_537], &[0]),
        (&[300_001, 1], &[0]),
        (&[70_001, 3], &[0]),
        (&[8, 1024, 96], &[0, 1]),
    ];
    for (i, (shape, dims)) in cases.iter().enumerate() {
        let what = format!("sum over {dims:?} of {shape:?}");
        let x = Tensor::randn_global(shape.to_vec(), 40 + i as u64, DType::F32, &pl, Sbp::B)
            .and_then(|t| t.abs())
            .and_then(|t| t.add_scalar(0.25))
            .map_err(|x| e(what.clone(), x))?;
        let got = x
            .sum(dims, false)
            .and_then(|s| s.to_vec::<f32>())
            .map_err(|x| e(what.clone(), x))?;
        let v = x.to_vec::<f32>().map_err(|x| e(what.clone(), x))?;
        let cols = if dims.len() == shape.len() {
            1
        } else {
            shape[dims.len()..].iter().product()
        };
        let mut want = vec![0f64; cols];
        for (j, &a) in v.iter().enumerate() {
            want[j % cols] += a as f64;
        }
        if got.len() != cols {
            return Err(format!("{what}: {} values, want {cols}", got.len()));
        }
        for (c, (&g, &w)) in got.iter().zip(&want).enumerate() {
            if ((g as f64) - w).abs() > 2e-4 * w.abs() {
                return Err(format!("{what}: column {c} is {g}, the f64 sum {w}"));
            }
        }
        checked += 1;
    }
    // (shape, the first reduced dim, how many): a short middle run beside a long inner one.
    let middle: [(&[usize], usize, usize); 4] = [
        (&[8192, 2, 1024], 1, 1),
        (&[3, 5, 7, 11], 1, 2),
        (&[2, 64, 3], 1, 1),
        (&[4, 65, 5], 1, 1),
    ];
    for (i, &(shape, first, n)) in middle.iter().enumerate() {
        let dims: Vec<isize> = (first..first + n).map(|d| d as isize).collect();
        let what = format!("reductions over {dims:?} of {shape:?}");
        let x = Tensor::randn_global(shape.to_vec(), 60 + i as u64, DType::F32, &pl, Sbp::B)
            .map_err(|x| e(what.clone(), x))?;
        let v = x.to_vec::<f32>().map_err(|x| e(what.clone(), x))?;
        let outer: usize = shape[..first].iter().product();
        let len: usize = shape[first..first + n].iter().product();
        let inner: usize = shape[first + n..].iter().product();
        let at = |o: usize, j: usize, c: usize| v[(o * len + j) * inner + c] as f64;
        let rows = |f: &dyn Fn(usize, usize) -> f64| -> Vec<f64> {
            (0..outer * inner)
                .map(|i| f(i / inner, i % inner))
                .collect()
        };
        let sum = rows(&|o, c| (0..len).map(|j| at(o, j, c)).sum());
        let mean: Vec<f64> = sum.iter().map(|s| s / len as f64).collect();
        let max = rows(&|o, c| (0..len).map(|j| at(o, j, c)).fold(f64::MIN, f64::max));
        let got = [
            x.sum(&dims, false),
            x.mean(&dims, false),
            x.max(&dims, false),
        ];
        for ((name, want), got) in [("sum", sum), ("mean", mean), ("max", max)].iter().zip(got) {
            let got = got
                .and_then(|g| g.to_vec::<f32>())
                .map_err(|x| e(format!("{name} {what}"), x))?;
            same_len(&format!("{name} {what}"), "values", &got, want)?;
            for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
                if ((g as f64) - w).abs() > 1e-5 * w.abs().max(1.0) {
                    return Err(format!("{name} {what}: output {k} is {g}, the host's {w}"));
                }
            }
        }
        checked += 1;
    }
    Ok(checked)
}
