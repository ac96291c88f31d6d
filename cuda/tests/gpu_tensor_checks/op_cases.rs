//! The GPU suite's op cases: a proptest strategy over element-wise, matrix, reduction,
//! softmax, layout, indexed and fused ops (with gradients) on random shapes and layouts, and
//! the op of a case run on inputs made locally (the CPU reference) or globally on the device.

use super::*;
use oxiflow_ops::attention::{flash_attention, flash_attention_lse};
use oxiflow_ops::classifier::{classifier_loss, classifier_loss_padded};
use oxiflow_ops::linear::linear;

/// One op case: the op family (`kind`), shapes, input layouts, a variant and a seed.
#[derive(Clone, Debug)]
pub(crate) struct OpCase {
    pub(crate) kind: usize,
    pub(crate) r: usize,
    pub(crate) c: usize,
    pub(crate) k: usize,
    pub(crate) sa: usize,
    pub(crate) sb: usize,
    pub(crate) v: usize,
    pub(crate) seed: u64,
}

pub(crate) fn op_strategy() -> impl Strategy<Value = OpCase> {
    (
        0..15usize,
        1..24usize,
        2..24usize,
        1..20usize,
        0..3usize,
        0..4usize,
        0..8usize,
        0..1000u64,
    )
        .prop_map(|(kind, r, c, k, sa, sb, v, seed)| OpCase {
            kind,
            r,
            c,
            k,
            sa,
            sb,
            v,
            seed,
        })
}

/// Makes an input: (shape, seed, 1-d sbp index: 0 S(0), 1 S(1), 2 B).
pub(crate) type Make<'a> = dyn Fn(&[usize], u64, usize) -> Result<Tensor> + 'a;

pub(crate) fn sbp_of(i: usize, ndim: usize) -> Sbp {
    match i {
        0 => Sbp::S(0),
        1 if ndim > 1 => Sbp::S(1),
        _ => Sbp::B,
    }
}

/// i64 labels `[rows]` in `0..k`: a made input's magnitudes times 1000, wrapped below `k`.
fn labels(mk: &Make, rows: usize, seed: u64, sbp: usize, k: usize) -> Result<Tensor> {
    let lab = mk(&[rows], seed, sbp)?
        .abs()?
        .mul_scalar(1000.0)?
        .cast(DType::I64)?;
    wrapped(&lab, k)
}

/// Non-negative i64 `lab` modulo `k` (through f64 division, exact for the small values here).
fn wrapped(lab: &Tensor, k: usize) -> Result<Tensor> {
    lab.sub(
        &lab.cast(DType::F64)?
            .mul_scalar(1.0 / k as f64)?
            .cast(DType::I64)?
            .mul_scalar(k as f64)?,
    )
}

/// The op of a case on inputs built by `mk` (local CPU or global CUDA); returns the outputs.
pub(crate) fn run_case(c: &OpCase, mk: &Make) -> Result<Vec<Tensor>> {
    let s = c.seed * 10;
    let x = || mk(&[c.r, c.c], s, c.sa);
    Ok(match c.kind {
        0 => {
            let u = [
                UnaryOp::Relu,
                UnaryOp::Gelu,
                UnaryOp::Exp,
                UnaryOp::Tanh,
                UnaryOp::Sigmoid,
                UnaryOp::Neg,
                UnaryOp::Square,
                UnaryOp::Abs,
            ][c.v];
            vec![
                x()?.unary(u)?,
                x()?.abs()?.add_scalar(0.5)?.unary(UnaryOp::Log)?,
            ]
        }
        1 => {
            let y = mk(&[c.c], s + 1, c.sb % 3)?.abs()?.add_scalar(0.5)?;
            let a = x()?;
            vec![
                a.add(&y)?,
                a.sub(&y)?,
                a.mul(&y)?,
                a.div(&y)?,
                a.mul_scalar(3.0)?.pow_scalar(2.0)?,
                // same shapes: the vectorised kernels
                a.add(&a.exp()?)?,
                a.mul(&a.tanh()?)?,
            ]
        }
        2 => {
            // (x sbp, w sbp) in {(S0,B), (B,S1), (S1,S0) -> P, (B,B)}
            let (xa, wa) = [(0, 2), (2, 1), (1, 0), (2, 2)][c.sb];
            let a = mk(&[c.r, c.k], s, xa)?;
            let w = mk(&[c.k, c.c], s + 1, wa)?;
            let b = mk(&[3, c.r, c.k], s + 2, c.sa % 2)?;
            let bw = mk(&[3, c.k, c.c], s + 3, c.sa % 2)?;
            // The same splits on operands stored transposed (gemm flags on the device).
            let wt = mk(&[c.c, c.k], s + 4, [2, 0, 1, 2][c.sb])?;
            let at = mk(&[c.k, c.r], s + 5, [1, 2, 0, 2][c.sb])?;
            let bwt = mk(&[3, c.c, c.k], s + 6, c.sa % 2)?;
            let bt = mk(&[3, c.k, c.r], s + 7, c.sa % 2)?;
            vec![
                a.matmul(&w)?,
                b.bmm(&bw)?,
                a.matmul_t(&wt, false, true)?,
                at.matmul_t(&w, true, false)?,
                at.matmul_t(&wt, true, true)?,
                b.matmul_t(&bwt, false, true)?,
                bt.matmul_t(&bw, true, false)?,
            ]
        }
        3 => {
            let d = (c.v % 2) as isize;
            let keep = c.v >= 4;
            let a = x()?;
            vec![
                a.sum(&[d], keep)?,
                a.mean(&[d], keep)?,
                a.max(&[d], keep)?,
                a.sum_all()?,
                a.mean_all()?,
            ]
        }
        4 => {
            let d = (c.v % 2) as isize;
            let a = x()?;
            vec![a.softmax(d)?, a.log_softmax(d)?]
        }
        5 => {
            let a = x()?;
            let t = a.transpose(0, 1)?;
            vec![
                t.clone(),
                a.narrow(1, 1, c.c - 1)?,
                Tensor::concat(&[&a, &a.neg()?], 1)?,
                // Along dim 0: ranges of odd lengths (byte copies) and whole rows.
                Tensor::concat(&[&a, &a.narrow(0, 0, 1)?, &a.mul_scalar(3.0)?], 0)?,
                t.reshape([c.c * c.r])?,
            ]
        }
        6 => {
            // layer norm with its statistics, RMS norm, and the fused AdamW custom op
            let w = mk(&[c.c], s + 1, 2)?;
            let b = mk(&[c.c], s + 2, 2)?;
            let (y, mean, rstd) = x()?.layer_norm_stats(&w, &b, 1e-5)?;
            let g = mk(&[c.r, c.c], s + 3, c.sa)?;
            let v = mk(&[c.r, c.c], s + 4, c.sa)?.abs()?;
            let p = x()?;
            vec![
                y,
                mean,
                rstd,
                p.rms_norm(&w, 1e-5)?,
                adam_moment(&p, &g, 0.9, 0.1, false)?,
                adam_moment(&v, &g, 0.999, 0.001, true)?,
                adam_update(&p, &g, &v, [0.99, 1e-2, 1.5, 1e-8])?,
            ]
        }
        7 => {
            let a = x()?;
            let lab = labels(mk, c.r, s + 1, c.sa % 3, c.c)?;
            let table = mk(&[c.c, c.k], s + 2, 2)?;
            vec![
                a.cross_entropy(&lab)?,
                Tensor::embedding(&lab, &table)?,
                lab.cast(DType::F32)?,
            ]
        }
        10 => {
            // flash attention on [B, T, H, D] (operands S(0), S(1) or B: the op takes batch or
            // heads splits, so S(1) boxes) and the probabilities on [B, H, T, D]; with gradients
            let (b, h, t, d, s2) = (1 + c.v % 3, 1 + c.sb, 1 + c.r % 6, 1 + c.k % 5, c.c % 7);
            let q = mk(&[b, t, h, d], s, c.sa)?.requires_grad_(true);
            let k = mk(&[b, t, h, d], s + 1, c.sa)?.requires_grad_(true);
            let v = mk(&[b, t, h, d + 1], s + 2, c.sa)?.requires_grad_(true);
            let k2 = mk(&[b, s2 + 1, h, d], s + 3, c.sa)?;
            let v2 = mk(&[b, s2 + 1, h, 2], s + 4, c.sa)?;
            let scale = 1.0 / (d as f64).sqrt();
            let y = flash_attention(&q, &k, &v, true, scale)?;
            y.square()?.mean_all()?.backward()?;
            let (y2, lse2) = flash_attention_lse(&q, &k2, &v2, false, scale)?;
            let heads = |x: &Tensor| x.permute(&[0, 2, 1, 3]);
            let mut out = vec![
                y,
                y2,
                lse2,
                heads(&q)?.attention_probs(&heads(&k2)?, false, scale)?,
            ];
            out.extend([&q, &k, &v].iter().filter_map(|t| t.grad()));
            out
        }
        11 => {
            // dropout: the device mask equals the host's, in any layout; with its gradient
            let a = x()?.requires_grad_(true);
            let y = a.dropout(0.3, c.seed)?;
            y.mul(&mk(&[c.r, c.c], s + 1, 2)?)?.sum_all()?.backward()?;
            let grads = a.grad().into_iter();
            let mut out = vec![y, mk(&[c.r, 3, c.c], s + 2, c.sa)?.dropout(0.75, !c.seed)?];
            out.extend(grads);
            out
        }
        12 | 13 => run_indexed_case(c, mk)?,
        14 => {
            // the fused custom ops with their gradients (residual LayerNorm, linear + GELU,
            // column-parallel or rows split, the classifier over every column and over
            // padded classes), and the multi-tensor AdamW
            let n = 8 * (1 + c.k % 3);
            let xa = x()?.requires_grad_(true);
            let aa = mk(&[c.r, c.c], s + 1, c.sa)?.requires_grad_(true);
            let w = mk(&[c.c], s + 2, 2)?.requires_grad_(true);
            let b = mk(&[c.c], s + 3, 2)?.requires_grad_(true);
            let fw = mk(&[c.c, n], s + 4, [2, 1][c.sb % 2])?.requires_grad_(true);
            let fb = mk(&[n], s + 5, [2, 0][c.sb % 2])?.requires_grad_(true);
            let (r, y) = residual_layer_norm(&xa, &aa, &w, &b, 1e-5)?;
            let h = linear(&y, &fw, Some(&fb), Activation::Gelu)?;
            let lab = labels(mk, c.r, s + 6, c.sa % 3, n)?;
            // Padded: the first n - 1 - v % 4 columns are the classes (labels wrapped to them).
            let classes = n - 1 - c.v % 4;
            let lab_p = wrapped(&lab, classes)?;
            let padded = classifier_loss_padded(&h, &lab_p, classes)?;
            let loss = classifier_loss(&h, &lab)?
                .mean_all()?
                .add(&padded.mean_all()?)?
                .add(&r.square()?.mean_all()?)?;
            loss.backward()?;
            let mut out = vec![r, y, h, padded, loss];
            out.extend([&xa, &aa, &w, &b, &fw, &fb].iter().filter_map(|t| t.grad()));
            let (p, g, m) = (x()?, mk(&[c.r, c.c], s + 7, c.sa)?, mk(&[c.c], s + 8, 2)?);
            let v = mk(&[c.c], s + 9, 2)?.abs()?;
            let slots = [
                AdamWSlot {
                    param: &p,
                    grad: &g,
                    m: None,
                    v: None,
                    weight_decay: 0.1,
                    compute_copy: None,
                    reuse: None,
                },
                AdamWSlot {
                    param: &w,
                    grad: &b,
                    m: Some(&m),
                    v: Some(&v),
                    weight_decay: 0.0,
                    compute_copy: None,
                    reuse: None,
                },
            ];
            let hyper = AdamWHyper {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                step: 2,
                grad_scale: 0.5,
            };
            for u in adamw_multi(&slots, &hyper)? {
                out.extend([u.param, u.m, u.v]);
            }
            out
        }
        _ => {
            // autograd through matmul, gelu, softmax, layer norm and cross-entropy
            let a = x()?.requires_grad_(true);
            let w = mk(&[c.c, c.k + 1], s + 1, [2, 1, 0][c.sa])?.requires_grad_(true);
            let g = mk(&[c.k + 1], s + 2, 2)?.requires_grad_(true);
            let bb = mk(&[c.k + 1], s + 3, 2)?.requires_grad_(true);
            let h = a.matmul(&w)?.gelu()?.layer_norm(&g, &bb, 1e-5)?;
            let lab = mk(&[c.r], s + 4, 2)?
                .abs()?
                .mul_scalar(0.0)?
                .cast(DType::I64)?;
            let loss = h
                .cross_entropy(&lab)?
                .mean_all()?
                .add(&h.softmax(1)?.square()?.mean_all()?)?;
            loss.backward()?;
            let grads = [&a, &w, &g, &bb]
                .iter()
                .filter_map(|t| t.grad())
                .collect::<Vec<_>>();
            let mut out = vec![loss];
            out.extend(grads);
            out
        }
    })
}
