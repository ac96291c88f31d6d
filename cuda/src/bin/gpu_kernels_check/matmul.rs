//! cuBLASLt product checks: every epilogue, β = 1 accumulation, batches, bf16/f16/f32/TF32,
//! against an f64 reference; timings of GPT-2 MLP shapes and the bf16 ceiling.

use std::sync::Arc;

use crate::harness::{rel_err, Buf, Report, Rng, TimingRun};
use oxiflow_cuda::kernel_layer::FloatType;
use oxiflow_cuda::kernel_layer::{lt_matmul, Epilogue, LtMatmul};
use oxiflow_cuda::CudaRuntime;
use oxiflow_tensor::{Result, UnaryOp};

/// GELU at `x` (the CPU kernels' arithmetic in f64).
pub(super) fn gelu(x: f64) -> f64 {
    UnaryOp::Gelu.eval_f64(x)
}
/// GELU's derivative at `x`.
pub(super) fn dgelu(x: f64) -> f64 {
    UnaryOp::Gelu.backward_f64(1.0, x)
}

/// Row-major `op(a) op(b)` of one batch entry.
fn product(g: &LtMatmul, a: &[f64], b: &[f64]) -> Vec<f64> {
    let (m, n, k) = (g.m, g.n, g.k);
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0;
            for p in 0..k {
                let av = if g.ta { a[p * m + i] } else { a[i * k + p] };
                let bv = if g.tb { b[j * k + p] } else { b[p * n + j] };
                s += av * bv;
            }
            out[i * n + j] = s;
        }
    }
    out
}

struct Case {
    name: &'static str,
    g: LtMatmul,
    tol: Option<f64>,
}

impl Case {
    /// Case `name` of `g` at its input type's tolerance.
    fn new(name: &'static str, g: LtMatmul) -> Case {
        Case { name, g, tol: None }
    }
}

fn base(m: usize, n: usize, k: usize, t: FloatType) -> LtMatmul {
    LtMatmul {
        batch: 1,
        m,
        n,
        k,
        ta: false,
        tb: true,
        strides: (0, 0, 0),
        in_type: t,
        out_type: t,
        tf32: false,
        alpha: 1.0,
        beta: 0.0,
        epilogue: Epilogue::None,
    }
}

fn check_case(rt: &Arc<CudaRuntime>, rep: &mut Report, c: &Case, seed: u64) -> Result<()> {
    let g = c.g;
    let mut rng = Rng(seed);
    let (na, nb, no) = (g.m * g.k, g.k * g.n, g.m * g.n);
    let (abuf, a) = Buf::vals(rt, g.in_type, &rng.vals(g.batch * na, 1.0))?;
    let (bbuf, b) = Buf::vals(rt, g.in_type, &rng.vals(g.batch * nb, 1.0))?;
    let (obuf, o0) = Buf::vals(rt, g.out_type, &rng.vals(g.batch * no, 1.0))?;
    if g.beta == 0.0 {
        obuf.poison(rt)?;
    }
    let side_len = match g.epilogue {
        Epilogue::BiasGradRows { .. } => g.m,
        _ => g.n,
    };
    let (bias_buf, bias) = Buf::vals(rt, g.out_type, &rng.vals(side_len, 1.0))?;
    let (pre_buf, pre_in) = Buf::vals(rt, g.out_type, &rng.vals(no, 1.0))?;
    let mut g = g;
    let (bp, pp) = (bias_buf.ptr(), pre_buf.ptr());
    g.epilogue = match g.epilogue {
        Epilogue::None => Epilogue::None,
        Epilogue::Bias { .. } => Epilogue::Bias { bias: bp },
        Epilogue::GeluAuxBias { .. } => Epilogue::GeluAuxBias { bias: bp, pre: pp },
        Epilogue::DGelu { .. } => Epilogue::DGelu { pre: pp },
        Epilogue::DGeluBiasGrad { .. } => Epilogue::DGeluBiasGrad {
            pre: pp,
            bias_grad: bp,
        },
        Epilogue::BiasGradRows { .. } => Epilogue::BiasGradRows { bias_grad: bp },
        Epilogue::BiasGradCols { .. } => Epilogue::BiasGradCols { bias_grad: bp },
    };
    let writes_side = matches!(
        g.epilogue,
        Epilogue::DGeluBiasGrad { .. }
            | Epilogue::BiasGradRows { .. }
            | Epilogue::BiasGradCols { .. }
    );
    if writes_side {
        bias_buf.poison(rt)?;
    }
    if matches!(g.epilogue, Epilogue::GeluAuxBias { .. }) {
        pre_buf.poison(rt)?;
    }
    let shape = format!(
        "b{} m{} n{} k{}{}{}",
        g.batch,
        g.m,
        g.n,
        g.k,
        if g.ta { " ta" } else { "" },
        if g.tb { " tb" } else { "" }
    );
    let dt = if g.tf32 {
        "tf32".to_string()
    } else {
        g.in_type.suffix().to_string()
    };
    let tol = c.tol.unwrap_or(crate::harness::tolerance(g.in_type));
    if let Err(e) = lt_matmul(rt, &g, abuf.ptr(), bbuf.ptr(), obuf.ptr()) {
        rep.fail(c.name, &dt, shape, e.to_string());
        return Ok(());
    }
    let mut want = Vec::with_capacity(g.batch * no);
    let mut want_pre = Vec::new();
    let mut want_side = vec![0.0; side_len];
    for e in 0..g.batch {
        let p = product(&g, &a[e * na..][..na], &b[e * nb..][..nb]);
        for (idx, &x) in p.iter().enumerate() {
            let j = idx % g.n;
            let base = g.alpha as f64 * x + g.beta as f64 * o0[e * no + idx];
            let v = match g.epilogue {
                Epilogue::Bias { .. } => base + bias[j],
                Epilogue::GeluAuxBias { .. } => {
                    want_pre.push(base + bias[j]);
                    gelu(base + bias[j])
                }
                Epilogue::DGelu { .. } | Epilogue::DGeluBiasGrad { .. } => {
                    base * dgelu(pre_in[idx])
                }
                _ => base,
            };
            if matches!(g.epilogue, Epilogue::DGeluBiasGrad { .. }) {
                want_side[j] += v;
            }
            want.push(v);
        }
        match g.epilogue {
            Epilogue::BiasGradRows { .. } => {
                let a = &a[e * na..][..na];
                for (i, w) in want_side.iter_mut().enumerate() {
                    *w += (0..g.k)
                        .map(|p| if g.ta { a[p * g.m + i] } else { a[i * g.k + p] })
                        .sum::<f64>();
                }
            }
            Epilogue::BiasGradCols { .. } => {
                let b = &b[e * nb..][..nb];
                for (j, w) in want_side.iter_mut().enumerate() {
                    *w += (0..g.k)
                        .map(|p| if g.tb { b[j * g.k + p] } else { b[p * g.n + j] })
                        .sum::<f64>();
                }
            }
            _ => {}
        }
    }
    let got = obuf.read(rt, g.out_type)?;
    rep.check_tol(c.name, &dt, shape.clone(), (rel_err(&got, &want), tol), "");
    if !want_pre.is_empty() {
        let pre = pre_buf.read(rt, g.out_type)?;
        rep.check_tol(
            &format!("{} (pre-activation)", c.name),
            &dt,
            shape.clone(),
            (rel_err(&pre, &want_pre), tol),
            "",
        );
    }
    if writes_side {
        let side = bias_buf.read(rt, g.out_type)?;
        rep.check_tol(
            &format!("{} (bias grad)", c.name),
            &dt,
            shape,
            (rel_err(&side, &want_side), tol),
            "",
        );
    }
    Ok(())
}

pub(super) fn checks(rt: &Arc<CudaRuntime>, rep: &mut Report) -> Result<()> {
    use FloatType::{Bf16, F16, F32};
    let (m, n, k) = (128, 192, 96);
    let e = |epi: Epilogue, t: FloatType| LtMatmul {
        epilogue: epi,
        ..base(m, n, k, t)
    };
    let z = 0;
    let wgrad = |epi: Epilogue| LtMatmul {
        ta: true,
        tb: false,
        out_type: F32,
        beta: 1.0,
        epilogue: epi,
        ..base(m, n, k, Bf16)
    };
    let cases = [
        Case::new("lt plain", e(Epilogue::None, Bf16)),
        Case::new("lt bias", e(Epilogue::Bias { bias: z }, Bf16)),
        Case::new(
            "lt gelu aux bias",
            e(Epilogue::GeluAuxBias { bias: z, pre: z }, Bf16),
        ),
        Case::new(
            "lt dgelu",
            LtMatmul {
                tb: false,
                ..e(Epilogue::DGelu { pre: z }, Bf16)
            },
        ),
        Case::new(
            "lt dgelu bgrad",
            LtMatmul {
                tb: false,
                ..e(
                    Epilogue::DGeluBiasGrad {
                        pre: z,
                        bias_grad: z,
                    },
                    Bf16,
                )
            },
        ),
        Case::new(
            "lt wgrad beta1 + bgrad rows",
            wgrad(Epilogue::BiasGradRows { bias_grad: z }),
        ),
        Case::new(
            "lt beta1 + bgrad cols",
            LtMatmul {
                ta: false,
                tb: false,
                ..wgrad(Epilogue::BiasGradCols { bias_grad: z })
            },
        ),
        Case::new(
            "lt batched",
            LtMatmul {
                batch: 3,
                strides: ((m * k) as i64, (k * n) as i64, (m * n) as i64),
                ..e(Epilogue::None, Bf16)
            },
        ),
        Case::new("lt bias", e(Epilogue::Bias { bias: z }, F16)),
        Case::new(
            "lt gelu aux bias",
            e(Epilogue::GeluAuxBias { bias: z, pre: z }, F16),
        ),
        Case::new("lt bias", e(Epilogue::Bias { bias: z }, F32)),
        Case {
            name: "lt tf32 plain",
            g: LtMatmul {
                tf32: true,
                ..e(Epilogue::None, F32)
            },
            tol: Some(1e-3),
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        check_case(rt, rep, c, 200 + i as u64)?;
    }
    Ok(())
}

/// bf16 TFLOP/s of an 8192^3 product (the matmul ceiling).
pub(super) fn ceiling(rt: &Arc<CudaRuntime>, repeats: usize) -> Result<f64> {
    let s = 8192;
    let g = LtMatmul {
        tb: false,
        ..base(s, s, s, FloatType::Bf16)
    };
    let mut rng = Rng(7);
    let (a, _) = Buf::vals(rt, FloatType::Bf16, &rng.vals(s * s, 1.0))?;
    let (b, _) = Buf::vals(rt, FloatType::Bf16, &rng.vals(s * s, 1.0))?;
    let o = Buf::new(rt, s * s * 2)?;
    let ms = lt_ms(rt, repeats, &g, [a.ptr(), b.ptr(), o.ptr()])?;
    Ok(2.0 * (s * s * s) as f64 / (ms * 1e-3) / 1e12)
}

/// Milliseconds a call of the product `g` of the buffers at `[a, b, out]` takes.
fn lt_ms(
    rt: &Arc<CudaRuntime>,
    repeats: usize,
    g: &LtMatmul,
    [a, b, out]: [u64; 3],
) -> Result<f64> {
    crate::harness::time_ms(rt, repeats, |_| {
        lt_matmul(rt, g, a, b, out).map_err(Into::into)
    })
}

/// Times the bf16 product `g` of the buffers at `ptrs` (a, b, out) and reports it under `what`
/// (name and shape), `flops` a call, against `ceiling`.
fn time_product(
    rt: &Arc<CudaRuntime>,
    rep: &mut Report,
    run: &TimingRun,
    (name, shape): (&str, String),
    g: &LtMatmul,
    ptrs: [u64; 3],
    (flops, ceiling): (f64, String),
) -> Result<()> {
    let ms = lt_ms(rt, run.repeats, g, ptrs)?;
    rep.time(name, "bf16", shape, ms, (flops, "TFLOP/s"), ceiling);
    Ok(())
}

pub(super) fn timings(rt: &Arc<CudaRuntime>, rep: &mut Report, run: &TimingRun) -> Result<()> {
    let (tokens, c, h) = (8192, 768, 3072);
    let mut rng = Rng(8);
    let (x, _) = Buf::vals(rt, FloatType::Bf16, &rng.vals(tokens * c, 1.0))?;
    let (w, _) = Buf::vals(rt, FloatType::Bf16, &rng.vals(h * c, 1.0))?;
    let (bias, _) = Buf::vals(rt, FloatType::Bf16, &rng.vals(h, 1.0))?;
    let pre = Buf::new(rt, tokens * h * 2)?;
    let out = Buf::new(rt, tokens * h * 2)?;
    let g = LtMatmul {
        epilogue: Epilogue::GeluAuxBias {
            bias: bias.ptr(),
            pre: pre.ptr(),
        },
        ..base(tokens, h, c, FloatType::Bf16)
    };
    let ceiling = format!("{:.0} TFLOP/s", run.mm);
    let flops = 2.0 * (tokens * h * c) as f64;
    let what = ("lt fc gelu aux bias", format!("{tokens}x{c} @ {c}x{h}"));
    let ptrs = [x.ptr(), w.ptr(), out.ptr()];
    time_product(rt, rep, run, what, &g, ptrs, (flops, ceiling.clone()))?;
    // Weight gradient dW[h, c] += dY^T X with the bias gradient, f32 out.
    let (dw, _) = Buf::vals(rt, FloatType::F32, &rng.vals(h * c, 1.0))?;
    let db = Buf::new(rt, h * 4)?;
    let (dy, _) = Buf::vals(rt, FloatType::Bf16, &rng.vals(tokens * h, 1.0))?;
    let g = LtMatmul {
        ta: true,
        tb: false,
        out_type: FloatType::F32,
        beta: 1.0,
        epilogue: Epilogue::BiasGradRows {
            bias_grad: db.ptr(),
        },
        ..base(h, c, tokens, FloatType::Bf16)
    };
    let what = (
        "lt wgrad beta1 bgrad",
        format!("{h}x{tokens} @ {tokens}x{c}"),
    );
    let ptrs = [dy.ptr(), x.ptr(), dw.ptr()];
    time_product(rt, rep, run, what, &g, ptrs, (flops, ceiling))?;
    Ok(())
}
