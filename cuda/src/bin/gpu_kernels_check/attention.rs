//! Fused attention checks: cuDNN and the NVRTC fallback, forward (O, log-sum-exp) and backward
//! (dQ, dK, dV, deterministic or not) against an f64 reference, Q/K/V read from one fused QKV
//! buffer `[B, T, 3, H, D]`, O and dO `[B, T, H, D]`; timings at B 16, H 12, T 1024, D 64.

use std::sync::Arc;

use rayon::prelude::*;

use crate::harness::{rel_err, Buf, Report, Rng, TimingRun};
use oxiflow_cuda::kernel_layer::upload;
use oxiflow_cuda::kernel_layer::{attention_backward, attention_forward, AttentionPath};
use oxiflow_cuda::kernel_layer::{cudnn_attention, flash_attention};
use oxiflow_cuda::kernel_layer::{
    AttentionBackward, AttentionForward, AttentionShape, Bhtd, FloatType,
};
use oxiflow_cuda::CudaRuntime;
use oxiflow_tensor::Result;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Cudnn,
    Flash,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    h: usize,
    t: usize,
    d: usize,
    causal: bool,
    dtype: FloatType,
}

impl Case {
    fn shape(&self) -> AttentionShape {
        AttentionShape {
            batch: self.b,
            heads: self.h,
            seq: self.t,
            head_dim: self.d,
            causal: self.causal,
            scale: 1.0 / (self.d as f32).sqrt(),
            dtype: self.dtype,
        }
    }
    fn label(&self) -> String {
        format!(
            "B{} H{} T{} D{}{}",
            self.b,
            self.h,
            self.t,
            self.d,
            if self.causal { " causal" } else { "" }
        )
    }
}

/// The f64 reference: O `[B, T, H, D]`, lse `[B, H, T]`, dQKV `[B, T, 3, H, D]`.
struct Reference {
    o: Vec<f64>,
    lse: Vec<f64>,
    dqkv: Vec<f64>,
}

fn reference(c: &Case, qkv: &[f64], d_o: &[f64]) -> Reference {
    let (b_, h_, t_, d_) = (c.b, c.h, c.t, c.d);
    let scale = c.shape().scale as f64;
    let qi = |b: usize, t: usize, w: usize, h: usize| (((b * t_ + t) * 3 + w) * h_ + h) * d_;
    let oi = |b: usize, t: usize, h: usize| ((b * t_ + t) * h_ + h) * d_;
    let per: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = (0..b_ * h_)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / h_, bh % h_);
            let mut o = vec![0.0; t_ * d_];
            let mut lse = vec![0.0; t_];
            let mut p = vec![0.0; t_ * t_];
            for i in 0..t_ {
                let q = &qkv[qi(b, i, 0, h)..][..d_];
                let n = if c.causal { i + 1 } else { t_ };
                let mut m = f64::NEG_INFINITY;
                for j in 0..n {
                    let k = &qkv[qi(b, j, 1, h)..][..d_];
                    let s = scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>();
                    p[i * t_ + j] = s;
                    m = m.max(s);
                }
                let mut l = 0.0;
                for j in 0..n {
                    let e = (p[i * t_ + j] - m).exp();
                    p[i * t_ + j] = e;
                    l += e;
                }
                for j in 0..n {
                    p[i * t_ + j] /= l;
                    let v = &qkv[qi(b, j, 2, h)..][..d_];
                    for d in 0..d_ {
                        o[i * d_ + d] += p[i * t_ + j] * v[d];
                    }
                }
                lse[i] = m + l.ln();
            }
            // Backward.
            let mut g = vec![0.0; 3 * t_ * d_];
            for i in 0..t_ {
                let go = &d_o[oi(b, i, h)..][..d_];
                let dsum: f64 = go.iter().zip(&o[i * d_..][..d_]).map(|(a, b)| a * b).sum();
                let n = if c.causal { i + 1 } else { t_ };
                let q = &qkv[qi(b, i, 0, h)..][..d_];
                for j in 0..n {
                    let v = &qkv[qi(b, j, 2, h)..][..d_];
                    let k = &qkv[qi(b, j, 1, h)..][..d_];
                    let pij = p[i * t_ + j];
                    let dp: f64 = go.iter().zip(v).map(|(a, b)| a * b).sum();
                    let ds = pij * (dp - dsum) * scale;
                    for d in 0..d_ {
                        g[i * d_ + d] += ds * k[d];
                        g[(t_ + j) * d_ + d] += ds * q[d];
                        g[(2 * t_ + j) * d_ + d] += pij * go[d];
                    }
                }
            }
            (o, lse, g)
        })
        .collect();
    let mut r = Reference {
        o: vec![0.0; b_ * t_ * h_ * d_],
        lse: vec![0.0; b_ * h_ * t_],
        dqkv: vec![0.0; b_ * t_ * 3 * h_ * d_],
    };
    for (bh, (o, lse, g)) in per.into_iter().enumerate() {
        let (b, h) = (bh / h_, bh % h_);
        for t in 0..t_ {
            r.o[oi(b, t, h)..][..d_].copy_from_slice(&o[t * d_..][..d_]);
            r.lse[bh * t_ + t] = lse[t];
            for w in 0..3 {
                r.dqkv[qi(b, t, w, h)..][..d_].copy_from_slice(&g[(w * t_ + t) * d_..][..d_]);
            }
        }
    }
    r
}

/// One of the Q, K, V parts (`w`) of a `[B, T, 3, H, D]` array.
fn part(c: &Case, all: &[f64], w: usize) -> Vec<f64> {
    let hd = c.h * c.d;
    all.chunks(3 * hd)
        .flat_map(|row| row[w * hd..][..hd].to_vec())
        .collect()
}

/// How Q, K, V (and dQ, dK, dV) are laid out.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    /// Three buffers `[B, T, H, D]` (three Linear outputs).
    Separate,
    /// Views of one fused buffer `[B, T, 3, H, D]`.
    Fused,
}

/// Device buffers of one case (the owned buffers and the views into them).
struct Bufs {
    _inputs: Vec<Buf>,
    grads: Vec<Buf>,
    qkv: [Bhtd; 3],
    dqkv: [Bhtd; 3],
    o: Buf,
    lse: Buf,
    d_o: Buf,
}

impl Bufs {
    fn fwd(&self, c: &Case) -> AttentionForward {
        let [q, k, v] = self.qkv;
        AttentionForward {
            shape: c.shape(),
            q,
            k,
            v,
            o: Bhtd::bthd(self.o.ptr(), c.t, c.h, c.d),
            lse: self.lse.ptr(),
        }
    }
    fn bwd(&self, c: &Case, deterministic: bool) -> AttentionBackward {
        let [q, k, v] = self.qkv;
        let [dq, dk, dv] = self.dqkv;
        AttentionBackward {
            shape: c.shape(),
            q,
            k,
            v,
            o: Bhtd::bthd(self.o.ptr(), c.t, c.h, c.d),
            d_o: Bhtd::bthd(self.d_o.ptr(), c.t, c.h, c.d),
            lse: self.lse.ptr(),
            dq,
            dk,
            dv,
            deterministic,
        }
    }
    fn poison_grads(&self, rt: &Arc<CudaRuntime>) -> Result<()> {
        self.grads.iter().try_for_each(|g| g.poison(rt))
    }
    /// dQ, dK, dV as `[B, T, H, D]` each.
    fn read_grads(&self, rt: &Arc<CudaRuntime>, c: &Case) -> Result<[Vec<f64>; 3]> {
        if self.grads.len() == 1 {
            let all = self.grads[0].read(rt, c.dtype)?;
            return Ok([0, 1, 2].map(|w| part(c, &all, w)));
        }
        Ok([
            self.grads[0].read(rt, c.dtype)?,
            self.grads[1].read(rt, c.dtype)?,
            self.grads[2].read(rt, c.dtype)?,
        ])
    }
    fn grad_bytes(&self, rt: &Arc<CudaRuntime>) -> Result<Vec<u8>> {
        let mut all = Vec::new();
        for g in &self.grads {
            all.extend(g.read_bytes(rt)?);
        }
        Ok(all)
    }
}

fn upload_case(
    rt: &Arc<CudaRuntime>,
    c: &Case,
    layout: Layout,
    rng: &mut Rng,
) -> Result<(Bufs, Vec<f64>, Vec<f64>)> {
    let n = c.b * c.t * c.h * c.d;
    let es = c.dtype.size();
    let (qkv_bytes, qkv_r) = crate::harness::encode(c.dtype, &rng.vals(3 * n, 1.0));
    let (d_o, d_o_r) = Buf::vals(rt, c.dtype, &rng.vals(n, 1.0))?;
    let (inputs, grads, qkv, dqkv) = match layout {
        Layout::Fused => {
            let i = Buf::from(rt, &qkv_bytes)?;
            let g = Buf::new(rt, 3 * n * es)?;
            let (qkv, dqkv) = (
                Bhtd::qkv(i.ptr(), es, c.t, c.h, c.d),
                Bhtd::qkv(g.ptr(), es, c.t, c.h, c.d),
            );
            (vec![i], vec![g], qkv, dqkv)
        }
        Layout::Separate => {
            let parts: Vec<Buf> = (0..3)
                .map(|w| Buf::from(rt, &crate::harness::encode(c.dtype, &part(c, &qkv_r, w)).0))
                .collect::<Result<_>>()?;
            let grads: Vec<Buf> = (0..3)
                .map(|_| Buf::new(rt, n * es))
                .collect::<Result<_>>()?;
            let view = |b: &Buf| Bhtd::bthd(b.ptr(), c.t, c.h, c.d);
            let (qkv, dqkv) = (
                [0, 1, 2].map(|w| view(&parts[w])),
                [0, 1, 2].map(|w| view(&grads[w])),
            );
            (parts, grads, qkv, dqkv)
        }
    };
    let bufs = Bufs {
        _inputs: inputs,
        grads,
        qkv,
        dqkv,
        o: Buf::new(rt, n * es)?,
        lse: Buf::new(rt, c.b * c.h * c.t * 4)?,
        d_o,
    };
    Ok((bufs, qkv_r, d_o_r))
}

fn run_fwd(rt: &Arc<CudaRuntime>, p: Path, a: &AttentionForward) -> Result<()> {
    match p {
        Path::Cudnn => cudnn_attention::forward(rt, a),
        Path::Flash => flash_attention::forward(rt, a),
    }
    .map_err(Into::into)
}

fn run_bwd(rt: &Arc<CudaRuntime>, p: Path, a: &AttentionBackward) -> Result<()> {
    match p {
        Path::Cudnn => cudnn_attention::backward(rt, a),
        Path::Flash => flash_attention::backward(rt, a),
    }
    .map_err(Into::into)
}

/// Checks one case on one path; errors of the path are recorded as failures.
fn check_case(
    rt: &Arc<CudaRuntime>,
    rep: &mut Report,
    c: &Case,
    p: Path,
    layout: Layout,
    seed: u64,
) -> Result<()> {
    let lay = if layout == Layout::Fused { " qkv" } else { "" };
    let name = |what: &str| {
        format!(
            "{}{lay} {what}",
            if p == Path::Cudnn {
                "cudnn attn"
            } else {
                "flash attn"
            }
        )
    };
    let mut rng = Rng(seed);
    let (bufs, qkv, d_o) = upload_case(rt, c, layout, &mut rng)?;
    let r = reference(c, &qkv, &d_o);
    bufs.o.poison(rt)?;
    bufs.lse.poison(rt)?;
    if let Err(e) = run_fwd(rt, p, &bufs.fwd(c)) {
        rep.fail(&name("fwd"), c.dtype.suffix(), c.label(), e.to_string());
        return Ok(());
    }
    let o = bufs.o.read(rt, c.dtype)?;
    let lse = bufs.lse.read(rt, FloatType::F32)?;
    rep.check(&name("fwd O"), c.dtype, c.label(), rel_err(&o, &r.o), "");
    rep.check(
        &name("fwd lse"),
        c.dtype,
        c.label(),
        rel_err(&lse, &r.lse),
        "f32 out",
    );
    // The backward reads the reference O and log-sum-exp (checked alone).
    let (o_bytes, _) = crate::harness::encode(c.dtype, &r.o);
    upload(rt, bufs.o.ptr(), &o_bytes, "kernel check")?;
    let (l_bytes, _) = crate::harness::encode(FloatType::F32, &r.lse);
    upload(rt, bufs.lse.ptr(), &l_bytes, "kernel check")?;
    let dets: &[bool] = if p == Path::Cudnn {
        &[false, true]
    } else {
        &[true]
    };
    for &det in dets {
        bufs.poison_grads(rt)?;
        let tag = if det { "det" } else { "" };
        if let Err(e) = run_bwd(rt, p, &bufs.bwd(c, det)) {
            rep.fail(
                &name(&format!("bwd {tag}")),
                c.dtype.suffix(),
                c.label(),
                e.to_string(),
            );
            continue;
        }
        let g = bufs.read_grads(rt, c)?;
        for (w, nm) in ["dQ", "dK", "dV"].iter().enumerate() {
            let err = rel_err(&g[w], &part(c, &r.dqkv, w));
            rep.check(
                &name(&format!("bwd {nm} {tag}")),
                c.dtype,
                c.label(),
                err,
                "",
            );
        }
        if det {
            let first = bufs.grad_bytes(rt)?;
            bufs.poison_grads(rt)?;
            run_bwd(rt, p, &bufs.bwd(c, det))?;
            let second = bufs.grad_bytes(rt)?;
            let differ = first.iter().zip(&second).filter(|(a, b)| a != b).count();
            rep.check_tol(
                &name("bwd det repeat"),
                c.dtype.suffix(),
                c.label(),
                (differ as f64, 0.0),
                "bytes differing between two runs",
            );
        }
    }
    Ok(())
}

pub(super) fn checks(rt: &Arc<CudaRuntime>, rep: &mut Report) -> Result<()> {
    let case = |b, h, t, d, causal, dtype| Case {
        b,
        h,
        t,
        d,
        causal,
        dtype,
    };
    let (sep, fused) = (Layout::Separate, Layout::Fused);
    // (case, path, layout, seed) of every correctness run, in order: per path, its sweep of
    // dtypes and causality (separate layout, [2, 3, t, 64]), then its single runs
    // `(b, h, t, d, causal, dtype, layout, seed)`.
    use FloatType::{Bf16, F16, F32};
    let cudnn_singles = [
        (2, 3, 256, 64, true, Bf16, fused, 39),
        (1, 2, 200, 128, true, Bf16, sep, 40),
    ];
    let flash_singles = [
        (2, 3, 160, 64, true, Bf16, fused, 49),
        (1, 2, 100, 128, true, F32, sep, 50),
        (1, 1, 70, 40, true, Bf16, sep, 51),
        (1, 2, 33, 256, false, F16, sep, 52),
    ];
    let paths = [
        (Path::Cudnn, 256, &[Bf16, F16][..], &cudnn_singles[..]),
        (Path::Flash, 160, &FloatType::ALL[..], &flash_singles[..]),
    ];
    let mut runs = Vec::new();
    let mut seed = 1;
    for (path, t, dtypes, singles) in paths {
        for &dtype in dtypes {
            for causal in [true, false] {
                seed += 1;
                runs.push((case(2, 3, t, 64, causal, dtype), path, sep, seed));
            }
        }
        for &(b, h, t, d, causal, dtype, layout, s) in singles {
            runs.push((case(b, h, t, d, causal, dtype), path, layout, s));
        }
    }
    for (c, path, layout, seed) in &runs {
        check_case(rt, rep, c, *path, *layout, *seed)?;
    }

    // cuDNN refuses f32 with a typed error and the dispatcher falls back.
    let c = case(1, 2, 64, 64, true, FloatType::F32);
    let (bufs, _, _) = upload_case(rt, &c, sep, &mut Rng(60))?;
    let typed = matches!(cudnn_attention::forward(rt, &bufs.fwd(&c)), Err(e) if e.is_fallback() && e.to_string().contains("f32"));
    let path = attention_forward(rt, &bufs.fwd(&c)).map_err(oxiflow_tensor::TensorError::from)?;
    let back =
        attention_backward(rt, &bufs.bwd(&c, false)).map_err(oxiflow_tensor::TensorError::from)?;
    let ok = typed
        && matches!(path, AttentionPath::Flash { .. })
        && matches!(back, AttentionPath::Flash { .. });
    rep.check_tol(
        "attn f32: cudnn typed refusal + fallback",
        "f32",
        c.label(),
        (if ok { 0.0 } else { 1.0 }, 0.0),
        format!("{path:?}"),
    );
    Ok(())
}

pub(super) fn timings(rt: &Arc<CudaRuntime>, rep: &mut Report, run: &TimingRun) -> Result<()> {
    let c = Case {
        b: 16,
        h: 12,
        t: 1024,
        d: 64,
        causal: true,
        dtype: FloatType::Bf16,
    };
    let mut rng = Rng(99);
    let sets: Vec<(Bufs, Vec<f64>, Vec<f64>)> = (0..2)
        .map(|_| upload_case(rt, &c, Layout::Separate, &mut rng))
        .collect::<Result<_>>()?;
    let fwd_flops = c.shape().forward_flops();
    let mm = format!("{:.0} TFLOP/s bf16 matmul", run.mm);
    for p in [Path::Cudnn, Path::Flash] {
        let nm = if p == Path::Cudnn {
            "cudnn attn"
        } else {
            "flash attn"
        };
        // Error at the timed shape, against f64 (cuDNN only: the fallback's is checked above).
        if p == Path::Cudnn {
            let (bufs, qkv, d_o) = &sets[0];
            let r = reference(&c, qkv, d_o);
            bufs.o.poison(rt)?;
            if let Err(e) = run_fwd(rt, p, &bufs.fwd(&c)) {
                rep.fail(
                    &format!("{nm} fwd O (timed shape)"),
                    "bf16",
                    c.label(),
                    e.to_string(),
                );
                continue;
            }
            let o = bufs.o.read(rt, c.dtype)?;
            rep.check(
                &format!("{nm} fwd O (timed shape)"),
                c.dtype,
                c.label(),
                rel_err(&o, &r.o),
                "",
            );
            bufs.poison_grads(rt)?;
            run_bwd(rt, p, &bufs.bwd(&c, false))?;
            let g = bufs.read_grads(rt, &c)?;
            for (w, gn) in ["dQ", "dK", "dV"].iter().enumerate() {
                let err = rel_err(&g[w], &part(&c, &r.dqkv, w));
                rep.check(
                    &format!("{nm} bwd {gn} (timed shape)"),
                    c.dtype,
                    c.label(),
                    err,
                    "device O, lse",
                );
            }
        }
        let reps = if p == Path::Flash {
            run.repeats.min(5)
        } else {
            run.repeats
        };
        for (what, backward, flops) in [
            ("fwd", false, fwd_flops),
            ("fwd+bwd", true, 3.5 * fwd_flops),
        ] {
            let timed = crate::harness::time_ms(rt, reps, |i| {
                let s = &sets[i % 2].0;
                run_fwd(rt, p, &s.fwd(&c))?;
                if backward {
                    run_bwd(rt, p, &s.bwd(&c, false))?;
                }
                Ok(())
            });
            match timed {
                Ok(ms) => rep.time(
                    &format!("{nm} {what}"),
                    "bf16",
                    c.label(),
                    ms,
                    (flops, "TFLOP/s"),
                    mm.clone(),
                ),
                Err(e) => rep.fail(
                    &format!("{nm} {what} timing"),
                    "bf16",
                    c.label(),
                    e.to_string(),
                ),
            }
        }
    }
    Ok(())
}
