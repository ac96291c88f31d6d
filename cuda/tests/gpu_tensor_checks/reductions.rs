//! Sums over large pieces (the multi-pass paths: a whole piece of a million elements, a few
//! columns of many rows, bias-gradient shapes) against f64 sums of the same values.

use super::*;

/// Sums of random (never zero) data, broadcast over `world` ranks of `device`, over the shapes whose reductions take several
/// passes, each within 2e-4 of the f64 sum (the host sums a million f32 values in order); returns how many were checked.
pub(crate) fn child_large_reductions(
    world: usize,
    device: DeviceType,
) -> std::result::Result<usize, String> {
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
    Ok(checked)
}
