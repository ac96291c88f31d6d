//! Checks of the fused NVRTC kernels (residual + LayerNorm forward and backward, vectorised
//! element-wise; AdamW in `adamw.rs`, the classifier in `classifier.rs`) against f64, and the
//! bandwidth timings of them and of AdamW.

use std::sync::Arc;

use crate::harness::{rel_err, Buf, Report, Rng, TimingRun};
use oxiflow_cuda::kernel_layer::FloatType;
use oxiflow_cuda::kernel_layer::{
    adamw_multi, elementwise, layer_norm_backward, layer_norm_forward, AdamHyper, AdamTensor,
    Elementwise, EwOp, LayerNormBackward, LayerNormForward,
};
use oxiflow_cuda::CudaRuntime;
use oxiflow_tensor::Result;

const EPS: f64 = 1e-5;

/// Row statistics (mean, rstd) of `r` `[rows, c]`.
fn stats(r: &[f64], c: usize) -> Vec<(f64, f64)> {
    r.chunks(c)
        .map(|row| {
            let mean = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / c as f64;
            (mean, 1.0 / (var + EPS).sqrt())
        })
        .collect()
}

fn ln_case(
    rt: &Arc<CudaRuntime>,
    rep: &mut Report,
    t: FloatType,
    rows: usize,
    c: usize,
    residual: bool,
    seed: u64,
) -> Result<()> {
    let mut rng = Rng(seed);
    let shape = format!("{rows}x{c}{}", if residual { " +res" } else { "" });
    let n = rows * c;
    let (x, xv) = Buf::vals(rt, t, &rng.vals(n, 1.0))?;
    let (a, av) = Buf::vals(rt, t, &rng.vals(n, 1.0))?;
    let (w, wv) = Buf::vals(rt, t, &rng.vals(c, 1.0))?;
    let (b, bv) = Buf::vals(rt, t, &rng.vals(c, 1.0))?;
    let (r, y) = (Buf::new(rt, n * t.size())?, Buf::new(rt, n * t.size())?);
    let (mean, rstd) = (Buf::new(rt, rows * 4)?, Buf::new(rt, rows * 4)?);
    for buf in [&r, &y, &mean, &rstd] {
        buf.poison(rt)?;
    }
    let args = LayerNormForward {
        rows,
        cols: c,
        eps: EPS as f32,
        dtype: t,
        x: x.ptr(),
        residual: residual.then(|| a.ptr()),
        weight: w.ptr(),
        bias: b.ptr(),
        sum_out: residual.then(|| r.ptr()),
        y: y.ptr(),
        mean: mean.ptr(),
        rstd: rstd.ptr(),
    };
    if let Err(e) = layer_norm_forward(rt, &args) {
        rep.fail("layernorm fwd", t.suffix(), shape, e.to_string());
        return Ok(());
    }
    let exact: Vec<f64> = if residual {
        xv.iter().zip(&av).map(|(p, q)| p + q).collect()
    } else {
        xv.clone()
    };
    let rr = crate::harness::encode(t, &exact).1;
    let st = stats(&rr, c);
    let want_y: Vec<f64> = rr
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let (m, s) = st[i / c];
            (v - m) * s * wv[i % c] + bv[i % c]
        })
        .collect();
    if residual {
        rep.check(
            "layernorm fwd residual sum",
            t,
            shape.clone(),
            rel_err(&r.read(rt, t)?, &exact),
            "",
        );
    }
    rep.check(
        "layernorm fwd y",
        t,
        shape.clone(),
        rel_err(&y.read(rt, t)?, &want_y),
        "",
    );
    let got_m = mean.read(rt, FloatType::F32)?;
    let got_s = rstd.read(rt, FloatType::F32)?;
    let want_m: Vec<f64> = st.iter().map(|s| s.0).collect();
    let want_s: Vec<f64> = st.iter().map(|s| s.1).collect();
    rep.check_f32_from(
        "layernorm fwd mean",
        t,
        shape.clone(),
        rel_err(&got_m, &want_m),
    );
    rep.check_f32_from(
        "layernorm fwd rstd",
        t,
        shape.clone(),
        rel_err(&got_s, &want_s),
    );

    // Backward from the rounded r and f32 statistics.
    let (rin, rv) = Buf::vals(rt, t, &rr)?;
    let (m32, mv) = Buf::vals(rt, FloatType::F32, &want_m)?;
    let (s32, sv) = Buf::vals(rt, FloatType::F32, &want_s)?;
    let (dy, dyv) = Buf::vals(rt, t, &rng.vals(n, 1.0))?;
    let (dres, dresv) = Buf::vals(rt, t, &rng.vals(n, 1.0))?;
    let (dw, dw0) = Buf::vals(rt, FloatType::F32, &rng.vals(c, 1.0))?;
    let (db, db0) = Buf::vals(rt, FloatType::F32, &rng.vals(c, 1.0))?;
    let dr = Buf::new(rt, n * t.size())?;
    dr.poison(rt)?;
    let args = LayerNormBackward {
        rows,
        cols: c,
        dtype: t,
        dy: dy.ptr(),
        r: rin.ptr(),
        mean: m32.ptr(),
        rstd: s32.ptr(),
        weight: w.ptr(),
        residual_grad: residual.then(|| dres.ptr()),
        dr: dr.ptr(),
        dweight: dw.ptr(),
        dbias: db.ptr(),
        grad_type: FloatType::F32,
        accumulate: true,
    };
    if let Err(e) = layer_norm_backward(rt, &args) {
        rep.fail("layernorm bwd", t.suffix(), shape, e.to_string());
        return Ok(());
    }
    let (mut want_dr, mut want_dw, mut want_db) = (vec![0.0; n], dw0.clone(), db0.clone());
    for i in 0..rows {
        let (m, s) = (mv[i], sv[i]);
        let row = |v: &[f64], j: usize| v[i * c + j];
        let xh: Vec<f64> = (0..c).map(|j| (row(&rv, j) - m) * s).collect();
        let g: Vec<f64> = (0..c).map(|j| row(&dyv, j) * wv[j]).collect();
        let mg = g.iter().sum::<f64>() / c as f64;
        let mgx = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / c as f64;
        for j in 0..c {
            want_dr[i * c + j] =
                s * (g[j] - mg - xh[j] * mgx) + if residual { row(&dresv, j) } else { 0.0 };
            want_dw[j] += row(&dyv, j) * xh[j];
            want_db[j] += row(&dyv, j);
        }
    }
    rep.check(
        "layernorm bwd dr",
        t,
        shape.clone(),
        rel_err(&dr.read(rt, t)?, &want_dr),
        "",
    );
    rep.check_f32_from(
        "layernorm bwd dweight (+=)",
        t,
        shape.clone(),
        rel_err(&dw.read(rt, FloatType::F32)?, &want_dw),
    );
    rep.check_f32_from(
        "layernorm bwd dbias (+=)",
        t,
        shape,
        rel_err(&db.read(rt, FloatType::F32)?, &want_db),
    );
    Ok(())
}

fn ew_checks(rt: &Arc<CudaRuntime>, rep: &mut Report) -> Result<()> {
    let n = 10007;
    let mut rng = Rng(400);
    for t in FloatType::ALL {
        for (op, nm) in [
            (EwOp::Add, "ew add"),
            (EwOp::Mul, "ew mul"),
            (EwOp::Scale, "ew scale"),
            (EwOp::Gelu, "ew gelu"),
            (EwOp::GeluBackward, "ew gelu bwd"),
        ] {
            for offset in [0usize, 1] {
                let (a, av) = Buf::vals(rt, t, &rng.vals(n, 2.0))?;
                let (b, bv) = Buf::vals(rt, t, &rng.vals(n, 2.0))?;
                let y = Buf::new(rt, n * t.size())?;
                y.poison(rt)?;
                let sz = (offset * t.size()) as u64;
                let m = n - offset;
                let c = 0.37f32;
                let shape = format!("n{m}{}", if offset > 0 { " unaligned" } else { " aligned" });
                if let Err(e) = elementwise(
                    rt,
                    &Elementwise {
                        op,
                        dtype: t,
                        n: m,
                        a: a.ptr() + sz,
                        b: b.ptr() + sz,
                        c,
                        y: y.ptr() + sz,
                    },
                ) {
                    rep.fail(nm, t.suffix(), shape, e.to_string());
                    continue;
                }
                let want: Vec<f64> = (offset..n)
                    .map(|i| {
                        let (x, z) = (av[i], bv[i]);
                        match op {
                            EwOp::Add => x + z,
                            EwOp::Mul => x * z,
                            EwOp::Scale => x * c as f64,
                            EwOp::Gelu => super::matmul::gelu(x),
                            EwOp::GeluBackward => x * super::matmul::dgelu(z),
                        }
                    })
                    .collect();
                let got = y.read(rt, t)?;
                rep.check(nm, t, shape, rel_err(&got[offset..], &want), "");
            }
        }
    }
    Ok(())
}

pub(super) fn checks(rt: &Arc<CudaRuntime>, rep: &mut Report) -> Result<()> {
    for (i, t) in FloatType::ALL.into_iter().enumerate() {
        let s = 100 + 10 * i as u64;
        ln_case(rt, rep, t, 64, 768, true, s)?;
        ln_case(rt, rep, t, 37, 100, false, s + 1)?;
        ln_case(rt, rep, t, 5, 1000, true, s + 2)?;
        ln_case(rt, rep, t, 33, 1024, false, s + 3)?;
        ln_case(rt, rep, t, 3, 2048, true, s + 4)?;
        // Many rows a warp (the warp-per-row backward's column partials over rows).
        ln_case(rt, rep, t, 4099, 256, true, s + 5)?;
    }
    super::adamw::checks(rt, rep)?;
    ew_checks(rt, rep)?;
    Ok(())
}

pub(super) fn timings(rt: &Arc<CudaRuntime>, rep: &mut Report, run: &TimingRun) -> Result<()> {
    let bw = format!("{:.0} GB/s copy", run.bw);
    let t = FloatType::Bf16;
    let mut rng = Rng(500);
    // Residual + LayerNorm, GPT-2 124M activations of 8 x 1024 tokens.
    let (rows, c) = (8192, 768);
    let n = rows * c;
    let (x, _) = Buf::vals(rt, t, &rng.vals(n, 1.0))?;
    let (a, _) = Buf::vals(rt, t, &rng.vals(n, 1.0))?;
    let (w, _) = Buf::vals(rt, t, &rng.vals(c, 1.0))?;
    let (b, _) = Buf::vals(rt, t, &rng.vals(c, 1.0))?;
    let (r, y) = (Buf::new(rt, n * 2)?, Buf::new(rt, n * 2)?);
    let (mean, rstd) = (Buf::new(rt, rows * 4)?, Buf::new(rt, rows * 4)?);
    let fwd = LayerNormForward {
        rows,
        cols: c,
        eps: 1e-5,
        dtype: t,
        x: x.ptr(),
        residual: Some(a.ptr()),
        weight: w.ptr(),
        bias: b.ptr(),
        sum_out: Some(r.ptr()),
        y: y.ptr(),
        mean: mean.ptr(),
        rstd: rstd.ptr(),
    };
    // A timing of the LayerNorm shape: four bf16 passes over the rows.
    let mut time_rows = |name: &str, f: &dyn Fn() -> Result<()>| -> Result<()> {
        let ms = crate::harness::time_ms(rt, run.repeats, |_| f())?;
        let work = ((4 * n * 2) as f64, "GB/s");
        rep.time(name, "bf16", format!("{rows}x{c}"), ms, work, bw.clone());
        Ok(())
    };
    time_rows("layernorm fwd +res", &|| {
        layer_norm_forward(rt, &fwd).map_err(Into::into)
    })?;
    let (dw, db) = (Buf::new(rt, c * 4)?, Buf::new(rt, c * 4)?);
    let dr = Buf::new(rt, n * 2)?;
    let bwd = LayerNormBackward {
        rows,
        cols: c,
        dtype: t,
        dy: y.ptr(),
        r: r.ptr(),
        mean: mean.ptr(),
        rstd: rstd.ptr(),
        weight: w.ptr(),
        residual_grad: Some(a.ptr()),
        dr: dr.ptr(),
        dweight: dw.ptr(),
        dbias: db.ptr(),
        grad_type: FloatType::F32,
        accumulate: false,
    };
    time_rows("layernorm bwd +res", &|| {
        layer_norm_backward(rt, &bwd).map_err(Into::into)
    })?;

    // AdamW over 124M parameters in 50 tensors, bf16 gradients, bf16 copies written.
    let (count, per) = (50, 2_480_000);
    let mut bufs = Vec::new();
    let pattern = 1 << 16;
    let (pv, gv, mv) = (
        rng.vals(pattern, 1.0),
        rng.vals(pattern, 0.1),
        rng.vals(pattern, 0.01),
    );
    let vv: Vec<f64> = rng.vals(pattern, 1e-3).iter().map(|x| x.abs()).collect();
    for _ in 0..count {
        let f = FloatType::F32;
        let p = Buf::repeat(rt, f, &pv, per)?;
        let g = Buf::repeat(rt, t, &gv, per)?;
        let m = Buf::repeat(rt, f, &mv, per)?;
        let v = Buf::repeat(rt, f, &vv, per)?;
        let copy = Buf::new(rt, per * 2)?;
        bufs.push((p, g, m, v, copy));
    }
    let hyper = AdamHyper {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        t: 10,
        grad_scale: 0.5,
    };
    let list: Vec<AdamTensor> = bufs
        .iter()
        .map(|(p, g, m, v, c)| AdamTensor {
            param: p.ptr(),
            grad: g.ptr(),
            m: m.ptr(),
            v: v.ptr(),
            param_out: p.ptr(),
            m_out: m.ptr(),
            v_out: v.ptr(),
            param_bf16: c.ptr(),
            n: per as i64,
            decay: hyper.decay(0.1),
            grad_bf16: 1,
        })
        .collect();
    let ms = crate::harness::time_ms(rt, run.repeats, |_| {
        adamw_multi(rt, &list, &hyper.coef()).map_err(Into::into)
    })?;
    rep.time(
        "adamw multi-tensor (1 launch)",
        "f32",
        format!("{count}x{per} bf16 grad"),
        ms,
        ((count * per * 28) as f64, "GB/s"),
        bw.clone(),
    );
    drop(bufs);

    // Vectorised add.
    let n = 64 << 20;
    let a = Buf::repeat(rt, t, &rng.vals(1 << 16, 1.0), n)?;
    let b = Buf::repeat(rt, t, &rng.vals((1 << 16) + 7, 1.0), n)?;
    let y = Buf::new(rt, n * 2)?;
    for (op, nm) in [
        (EwOp::Add, "ew add (16-byte)"),
        (EwOp::GeluBackward, "ew gelu bwd (16-byte)"),
    ] {
        let e = Elementwise {
            op,
            dtype: t,
            n,
            a: a.ptr(),
            b: b.ptr(),
            c: 0.0,
            y: y.ptr(),
        };
        let ms =
            crate::harness::time_ms(rt, run.repeats, |_| elementwise(rt, &e).map_err(Into::into))?;
        rep.time(
            nm,
            "bf16",
            format!("n{n}"),
            ms,
            ((3 * n * 2) as f64, "GB/s"),
            bw.clone(),
        );
    }
    Ok(())
}
