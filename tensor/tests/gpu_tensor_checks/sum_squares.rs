//! The multi-tensor sum of squares on the device against f64 sums of the same values (every
//! float dtype, a million elements, empty and split pieces, hundreds of tensors in one op,
//! the `x * 0` flags), bit-equal on a second run; and the multi-tensor AdamW's compute copies
//! (bf16 from the fused launch, f16 cast after it) bit for bit the casts of the new values.

use oxiflow_tensor::custom::TensorSums;

use super::*;

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

/// The bits of `t`'s values (every NaN as one NaN).
pub(super) fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.cast(DType::F64)?
        .to_vec::<f64>()?
        .iter()
        .map(|v| if v.is_nan() { f64::NAN } else { *v }.to_bits())
        .collect())
}

/// Sums of random never-zero data on `world` ranks of `device`, split and broadcast, within
/// 1e-10 of the host's f64 sums; returns how many tensors were checked.
pub(crate) fn child_sum_squares(
    world: usize,
    device: DeviceType,
) -> std::result::Result<usize, String> {
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
        let TensorSums { each, total } =
            Tensor::sum_squares_multi(&refs).map_err(|x| e("op", x))?;
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
        let again = Tensor::sum_squares_multi(&refs).map_err(|x| e("again", x))?;
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
    let flags = Tensor::non_finite_sums(&refs)
        .and_then(|s| s.each.to_vec::<f64>())
        .map_err(|x| e("flags", x))?;
    if !(flags[0] == 0.0 && flags[1].is_nan() && flags[2] == 0.0 && flags[3].is_nan()) {
        return Err(format!("non-finite flags {flags:?}"));
    }
    Ok(checked)
}

/// The multi-tensor AdamW's compute copies on `device`: each bit for bit the cast of its new
/// value (bf16 written by the fused launch, f16 by a cast after it); and a clip ratio read
/// on the device gives the bits of its factor folded on the host; returns how many checked.
pub(crate) fn child_adamw_copies(
    world: usize,
    device: DeviceType,
) -> std::result::Result<usize, String> {
    let e = |err: oxiflow_tensor::TensorError| format!("adamw copies: {err}");
    let pl =
        Placement::new_1d(device, (0..world).collect::<Vec<_>>()).map_err(|x| x.to_string())?;
    let mk = |n: usize, seed: u64| Tensor::randn_global([n, 3], seed, DType::F32, &pl, Sbp::S(0));
    let sizes = [1usize, 7, 4099, 65_537];
    let mut four = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let s = 10 * i as u64;
        four.push([
            mk(n, s),
            mk(n, s + 1),
            mk(n, s + 2),
            mk(n, s + 3).and_then(|v| v.abs()),
        ]);
    }
    let four: Vec<[Tensor; 4]> = four
        .into_iter()
        .map(|f| {
            let [a, b, c, d] = f;
            Ok([a?, b?, c?, d?])
        })
        .collect::<Result<_>>()
        .map_err(e)?;
    let copies = [Some(DType::BF16), Some(DType::F16), None, Some(DType::BF16)];
    let slots: Vec<AdamWSlot> = four
        .iter()
        .zip(copies)
        .map(|(t, c)| AdamWSlot {
            param: &t[0],
            grad: &t[1],
            m: Some(&t[2]),
            v: Some(&t[3]),
            weight_decay: 0.1,
            compute_copy: c,
            reuse: None,
        })
        .collect();
    let hyper = AdamWHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        step: 3,
        grad_scale: 0.7,
    };
    let out = Tensor::adamw_multi(&slots, &hyper).map_err(e)?;
    let mut checked = 0;
    for (i, (u, c)) in out.iter().zip(copies).enumerate() {
        match (&u.copy, c) {
            (Some(copy), Some(d)) => {
                let cast = u.param.to_dtype(d).map_err(e)?;
                if bits(copy).map_err(e)? != bits(&cast).map_err(e)? {
                    return Err(format!(
                        "adamw copies: tensor {i}'s {d} copy is not its cast"
                    ));
                }
                checked += 1;
            }
            (None, None) => {}
            (got, _) => return Err(format!("adamw copies: tensor {i}: copy {got:?} for {c:?}")),
        }
    }
    // The clip factor as a device ratio r (min(r, 1) = 0.7, r > 1 for 1, and NaN, a
    // non-finite norm's, for NaN): the same bits as the factor folded on the host.
    for (ratio, factor) in [(0.7, 0.7), (3.5, 1.0), (f64::NAN, f64::NAN)] {
        let r = Tensor::from_vec(vec![ratio], Vec::<usize>::new())
            .and_then(|r| r.to_global(&pl, vec![Sbp::B]))
            .map_err(e)?;
        let host = AdamWHyper {
            grad_scale: factor,
            ..hyper
        };
        let want = Tensor::adamw_multi(&slots, &host).map_err(e)?;
        let got = Tensor::adamw_multi_clipped(&slots, &hyper_unclipped(&hyper), &r).map_err(e)?;
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let pairs = [(&a.param, &b.param), (&a.m, &b.m), (&a.v, &b.v)];
            for (x, y) in pairs.into_iter().chain(a.copy.iter().zip(b.copy.iter())) {
                if bits(x).map_err(e)? != bits(y).map_err(e)? {
                    return Err(format!(
                        "adamw clip ratio {ratio}: tensor {i} differs from the host's factor {factor}"
                    ));
                }
            }
            checked += 1;
        }
    }
    Ok(checked)
}

/// `hyper` with its gradients unscaled (a clip ratio operand scales them).
fn hyper_unclipped(hyper: &AdamWHyper) -> AdamWHyper {
    AdamWHyper {
        grad_scale: 1.0,
        ..*hyper
    }
}
