//! The multi-tensor AdamW check: four tensors (f32 and bf16 gradients, with and without the
//! bf16 parameter copy, different weight decays) against f64, and bitwise against the three
//! `adam_f32` passes of `ElementwiseOp::Adam` run on copies of the same inputs.

use std::sync::Arc;

use crate::harness::{rel_err, Buf, Report, Rng};
use oxiflow_cuda::kernel_layer::FloatType;
use oxiflow_cuda::kernel_layer::{adamw_multi, AdamHyper, AdamTensor};
use oxiflow_cuda::kernel_layer::{grid, launch, Template};
use oxiflow_cuda::CudaRuntime;
use oxiflow_dtype::DType;
use oxiflow_tensor::Result;

/// One AdamW tensor on the device with its host values.
struct AdamCase {
    p: Buf,
    g: Buf,
    m: Buf,
    v: Buf,
    copy: Option<Buf>,
    vals: [Vec<f64>; 4],
    grad_bf16: bool,
    wd: f64,
}

pub(super) fn checks(rt: &Arc<CudaRuntime>, rep: &mut Report) -> Result<()> {
    let hyper = AdamHyper {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        t: 3,
        grad_scale: 1.0,
    };
    let mut rng = Rng(300);
    let mut cases = Vec::new();
    for (i, (n, gb, copy, wd)) in [
        (1000, false, true, 0.1),
        (4097, true, false, 0.0),
        (33, false, false, 0.1),
        (70001, true, true, 0.05),
    ]
    .into_iter()
    .enumerate()
    {
        let f = FloatType::F32;
        let gt = if gb { FloatType::Bf16 } else { f };
        let (p, pv) = Buf::vals(rt, f, &rng.vals(n, 1.0))?;
        let (g, gv) = Buf::vals(rt, gt, &rng.vals(n, 0.1))?;
        let (m, mv) = Buf::vals(rt, f, &rng.vals(n, 0.01))?;
        let vv: Vec<f64> = rng.vals(n, 1e-3).iter().map(|x| x.abs()).collect();
        let (v, vv) = Buf::vals(rt, f, &vv)?;
        let copy = if copy {
            Some(Buf::new(rt, n * 2)?)
        } else {
            None
        };
        if let Some(c) = &copy {
            c.poison(rt)?;
        }
        let _ = i;
        cases.push(AdamCase {
            p,
            g,
            m,
            v,
            copy,
            vals: [pv, gv, mv, vv],
            grad_bf16: gb,
            wd,
        });
    }
    let list: Vec<AdamTensor> = cases
        .iter()
        .map(|c| AdamTensor {
            param: c.p.ptr(),
            grad: c.g.ptr(),
            m: c.m.ptr(),
            v: c.v.ptr(),
            param_out: c.p.ptr(),
            m_out: c.m.ptr(),
            v_out: c.v.ptr(),
            param_bf16: c.copy.as_ref().map_or(0, Buf::ptr),
            n: c.vals[0].len() as i64,
            decay: hyper.decay(c.wd),
            grad_bf16: c.grad_bf16 as i32,
        })
        .collect();
    // The three-pass kernels on copies of the f32-gradient tensors, for the bitwise check.
    let op = "kernel check adam";
    let mut three_pass = Vec::new();
    for c in cases.iter().filter(|c| !c.grad_bf16) {
        let n = c.vals[0].len();
        let (p, _) = Buf::vals(rt, FloatType::F32, &c.vals[0])?;
        let (m, _) = Buf::vals(rt, FloatType::F32, &c.vals[2])?;
        let (v, _) = Buf::vals(rt, FloatType::F32, &c.vals[3])?;
        let (m2, v2, p2) = (
            Buf::new(rt, n * 4)?,
            Buf::new(rt, n * 4)?,
            Buf::new(rt, n * 4)?,
        );
        let (bc1, bc2) = (
            1.0 - hyper.beta1.powi(hyper.t),
            1.0 - hyper.beta2.powi(hyper.t),
        );
        let nn = n as i64;
        let (gp, mp, vp, m2p, v2p, pp, p2p) = (
            c.g.ptr(),
            m.ptr(),
            v.ptr(),
            m2.ptr(),
            v2.ptr(),
            p.ptr(),
            p2.ptr(),
        );
        let (part0, part1, part2, zero) = (0i32, 1i32, 2i32, 0.0f64);
        let (a1, b1, a2, b2) = (
            hyper.beta1,
            1.0 - hyper.beta1,
            hyper.beta2,
            1.0 - hyper.beta2,
        );
        let (decay, step, inv_bc2, eps) =
            (1.0 - hyper.lr * c.wd, hyper.lr / bc1, 1.0 / bc2, hyper.eps);
        launch!(rt, op, Template::Adam.at(DType::F32), grid(n); nn, part0, a1, b1, zero, zero, mp, gp, gp, m2p)?;
        launch!(rt, op, Template::Adam.at(DType::F32), grid(n); nn, part1, a2, b2, zero, zero, vp, gp, gp, v2p)?;
        launch!(rt, op, Template::Adam.at(DType::F32), grid(n); nn, part2, decay, step, inv_bc2, eps, pp, m2p, v2p, p2p)?;
        three_pass.push((p2, m2, v2));
    }
    if let Err(e) = adamw_multi(rt, &list, &hyper.coef()) {
        rep.fail(
            "adamw multi-tensor",
            "f32",
            "4 tensors".into(),
            e.to_string(),
        );
        return Ok(());
    }
    let (bc1, bc2) = (
        1.0 - hyper.beta1.powi(hyper.t),
        1.0 - hyper.beta2.powi(hyper.t),
    );
    let mut tp = three_pass.iter();
    for c in &cases {
        let n = c.vals[0].len();
        let [pv, gv, mv, vv] = &c.vals;
        let (mut wp, mut wm, mut wv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for i in 0..n {
            wm[i] = hyper.beta1 * mv[i] + (1.0 - hyper.beta1) * gv[i];
            wv[i] = hyper.beta2 * vv[i] + (1.0 - hyper.beta2) * gv[i] * gv[i];
            wp[i] = pv[i] * (1.0 - hyper.lr * c.wd)
                - hyper.lr * (wm[i] / bc1) / ((wv[i] / bc2).sqrt() + hyper.eps);
        }
        let shape = format!(
            "n{n}{}{}",
            if c.grad_bf16 { " bf16 grad" } else { "" },
            if c.copy.is_some() { " +bf16 copy" } else { "" }
        );
        let f = FloatType::F32;
        let (gp, gm, gvv) = (c.p.read(rt, f)?, c.m.read(rt, f)?, c.v.read(rt, f)?);
        rep.check("adamw param", f, shape.clone(), rel_err(&gp, &wp), "");
        rep.check("adamw exp_avg", f, shape.clone(), rel_err(&gm, &wm), "");
        rep.check("adamw exp_avg_sq", f, shape.clone(), rel_err(&gvv, &wv), "");
        if let Some(copy) = &c.copy {
            let want = crate::harness::encode(FloatType::Bf16, &gp).1;
            rep.check_tol(
                "adamw bf16 copy == round(param)",
                "bf16",
                shape.clone(),
                (rel_err(&copy.read(rt, FloatType::Bf16)?, &want), 0.0),
                "exact",
            );
        }
        if !c.grad_bf16 {
            if let Some((p2, m2, v2)) = tp.next() {
                let differ = [(&c.p, p2), (&c.m, m2), (&c.v, v2)]
                    .iter()
                    .map(|(a, b)| {
                        Ok(a.read_bytes(rt)?
                            .iter()
                            .zip(b.read_bytes(rt)?)
                            .filter(|(x, y)| **x != *y)
                            .count())
                    })
                    .sum::<Result<usize>>()?;
                rep.check_tol(
                    "adamw == ElementwiseOp::Adam 3 passes",
                    "f32",
                    shape,
                    (differ as f64, 0.0),
                    "bytes differing",
                );
            }
        }
    }
    Ok(())
}
