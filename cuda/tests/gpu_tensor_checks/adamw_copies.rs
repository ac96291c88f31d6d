//! The multi-tensor AdamW's compute copies (bf16 from the fused launch, f16 cast after it) bit
//! for bit the casts of the new values (the sum of squares' device check is the ops crate's,
//! `ops/tests/sum_squares_cuda.rs`).

use super::*;

/// The bits of `t`'s values (every NaN as one NaN).
pub(super) fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.cast(DType::F64)?
        .to_vec::<f64>()?
        .iter()
        .map(|v| if v.is_nan() { f64::NAN } else { *v }.to_bits())
        .collect())
}

/// The multi-tensor AdamW's compute copies on `device`: each bit for bit the cast of its new
/// value (bf16 written by the fused launch, f16 by a cast after it); and a clip ratio read
/// on the device gives the bits of its factor folded on the host; returns how many checked.
pub(crate) fn child_adamw_copies(world: usize, device: DeviceType) -> Checked {
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
    let hyper = adamw_hyper(0.7);
    let out = adamw_multi(&slots, &hyper).map_err(e)?;
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
        let want = adamw_multi(&slots, &adamw_hyper(factor)).map_err(e)?;
        // The ratio operand scales the gradients: the hyper-parameters leave them unscaled.
        let got = adamw_multi_clipped(&slots, &adamw_hyper(1.0), &r).map_err(e)?;
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
