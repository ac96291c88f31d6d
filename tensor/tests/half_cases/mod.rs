//! The 16-bit op cases shared by the CPU tests (`half_ops.rs`) and the GPU suite
//! (`gpu_tensor.rs`): every op family run on bf16/f16 inputs of random, never-zero values,
//! compared with the same op on the f64 values of those inputs. A kernel that computes in f32
//! and rounds once is within half a 16-bit ulp of the f64 result (plus f32 error); `ulps` says
//! how many rounding steps a case may take (ops composed of several 16-bit steps, gradients).
#![allow(dead_code)]

use oxiflow_ops::attention::{flash_attention, flash_attention_lse};
use oxiflow_ops::classifier::{classifier_loss, classifier_loss_padded};
use oxiflow_ops::linear::linear;
use oxiflow_ops::residual_layer_norm::residual_layer_norm;
use oxiflow_tensor::{DType, Placement, Result, Sbp, Tensor, UnaryOp};

/// What an input holds.
#[derive(Clone, Copy, Debug)]
pub enum Input {
    /// Random values of magnitude 0.25..2, either sign.
    Float,
    /// Random values in 0.25..2.
    Positive,
    /// i64 ids in 0..n.
    Ids(usize),
}

/// One case: input shapes and kinds, the op, and the rounding steps it may take.
pub struct HalfCase {
    pub name: &'static str,
    pub inputs: Vec<(Vec<usize>, Input)>,
    pub ulps: f64,
    pub op: fn(&[Tensor]) -> Result<Tensor>,
}

fn case(
    name: &'static str,
    inputs: &[(&[usize], Input)],
    ulps: f64,
    op: fn(&[Tensor]) -> Result<Tensor>,
) -> HalfCase {
    HalfCase {
        name,
        inputs: inputs.iter().map(|(s, k)| (s.to_vec(), *k)).collect(),
        ulps,
        op,
    }
}

/// Gradient of `sum(f(x) * w)` with respect to x (w a fixed ramp, so every output counts).
fn grad_of(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let x = x.detach().requires_grad_(true);
    let y = f(&x)?;
    let n = y.shape().numel();
    let w = Tensor::arange(1.0, 1.0 + n as f64, 1.0, DType::F64)?
        .scale(1.0 / n as f64)?
        .to_dtype(y.dtype())?
        .reshape(y.shape().clone())?;
    let w = match y.placement() {
        Some(p) => w.to_global(p, vec![Sbp::B; p.ndim()])?,
        None => w,
    };
    y.mul(&w)?.sum_all()?.backward()?;
    x.grad().ok_or_else(|| oxiflow_tensor::TensorError::Kernel {
        op: "grad",
        detail: "no gradient".into(),
    })
}

const F: Input = Input::Float;
const P: Input = Input::Positive;

/// Every case.
pub fn half_cases() -> Vec<HalfCase> {
    use UnaryOp::*;
    let mut v = vec![
        case("relu", &[(&[5, 7], F)], 1.0, |x| x[0].unary(Relu)),
        case("gelu", &[(&[5, 7], F)], 1.0, |x| x[0].unary(Gelu)),
        case("exp", &[(&[5, 7], F)], 1.0, |x| x[0].unary(Exp)),
        case("log", &[(&[5, 7], P)], 1.0, |x| x[0].unary(Log)),
        case("tanh", &[(&[5, 7], F)], 1.0, |x| x[0].unary(Tanh)),
        case("sigmoid", &[(&[5, 7], F)], 1.0, |x| x[0].unary(Sigmoid)),
        case("sqrt", &[(&[5, 7], P)], 1.0, |x| x[0].unary(Sqrt)),
        case("neg", &[(&[5, 7], F)], 1.0, |x| x[0].unary(Neg)),
        case("abs", &[(&[5, 7], F)], 1.0, |x| x[0].unary(Abs)),
        case("square", &[(&[5, 7], F)], 1.0, |x| x[0].unary(Square)),
        case("add", &[(&[5, 7], F), (&[7], F)], 1.0, |x| x[0].add(&x[1])),
        case("sub", &[(&[5, 7], F), (&[5, 1], F)], 1.0, |x| {
            x[0].sub(&x[1])
        }),
        case("mul", &[(&[5, 7], F), (&[5, 7], F)], 1.0, |x| {
            x[0].mul(&x[1])
        }),
        case("div", &[(&[5, 7], F), (&[7], P)], 1.0, |x| x[0].div(&x[1])),
        case("add_scalar", &[(&[5, 7], F)], 1.0, |x| x[0].add_scalar(0.3)),
        case("mul_scalar", &[(&[5, 7], F)], 1.0, |x| {
            x[0].mul_scalar(-1.7)
        }),
        case("rdiv_scalar", &[(&[5, 7], F)], 1.0, |x| {
            x[0].rdiv_scalar(2.0)
        }),
        case("pow_scalar", &[(&[5, 7], P)], 1.0, |x| x[0].pow_scalar(1.5)),
        case("matmul", &[(&[6, 33], F), (&[33, 5], F)], 1.0, |x| {
            x[0].matmul(&x[1])
        }),
        case("bmm", &[(&[2, 4, 9], F), (&[2, 9, 3], F)], 1.0, |x| {
            x[0].bmm(&x[1])
        }),
        case("matmul_t", &[(&[9, 6], F), (&[5, 9], F)], 1.0, |x| {
            x[0].matmul_t(&x[1], true, true)
        }),
        case("sum", &[(&[6, 40], F)], 1.0, |x| x[0].sum(&[1], false)),
        case("sum_all", &[(&[6, 40], F)], 1.0, |x| x[0].sum_all()),
        case("mean", &[(&[6, 40], F)], 1.0, |x| x[0].mean(&[0], true)),
        case("max", &[(&[6, 40], F)], 1.0, |x| x[0].max(&[1], false)),
        case("min", &[(&[6, 40], F)], 1.0, |x| x[0].min(&[0], false)),
        case("softmax", &[(&[4, 30], F)], 1.0, |x| x[0].softmax(1)),
        case("softmax_dim0", &[(&[30, 4], F)], 1.0, |x| x[0].softmax(0)),
        case("log_softmax", &[(&[4, 30], F)], 1.0, |x| {
            x[0].log_softmax(1)
        }),
        case(
            "layer_norm",
            &[(&[4, 24], F), (&[24], F), (&[24], F)],
            1.0,
            |x| x[0].layer_norm(&x[1], &x[2], 1e-5),
        ),
        case("rms_norm", &[(&[4, 24], F), (&[24], F)], 1.0, |x| {
            x[0].rms_norm(&x[1], 1e-5)
        }),
        case(
            "flash_attention",
            &[(&[1, 6, 2, 8], F), (&[1, 6, 2, 8], F), (&[1, 6, 2, 8], F)],
            4.0,
            |x| flash_attention(&x[0], &x[1], &x[2], true, 0.35),
        ),
        case(
            "flash_attention_lse",
            &[(&[2, 6, 2, 8], F), (&[2, 6, 2, 8], F), (&[2, 6, 2, 8], F)],
            1.0,
            |x| Ok(flash_attention_lse(&x[0], &x[1], &x[2], false, 0.35)?.1),
        ),
        case(
            "flash_attention_cross",
            &[(&[1, 6, 2, 8], F), (&[1, 5, 2, 8], F), (&[1, 5, 2, 4], F)],
            4.0,
            |x| flash_attention(&x[0], &x[1], &x[2], false, 0.35),
        ),
        case(
            "attention_probs",
            &[(&[1, 2, 6, 8], F), (&[1, 2, 5, 8], F)],
            2.0,
            |x| x[0].attention_probs(&x[1], false, 0.35),
        ),
        case(
            "embedding",
            &[(&[7], Input::Ids(9)), (&[9, 5], F)],
            1.0,
            |x| Tensor::embedding(&x[0], &x[1]),
        ),
        case(
            "cross_entropy",
            &[(&[6, 11], F), (&[6], Input::Ids(11))],
            1.0,
            |x| x[0].cross_entropy(&x[1]),
        ),
        case(
            "gather",
            &[(&[5, 7], F), (&[5, 3], Input::Ids(7))],
            1.0,
            |x| x[0].gather(1, &x[1]),
        ),
        case(
            "index_select",
            &[(&[5, 7], F), (&[4], Input::Ids(5))],
            1.0,
            |x| x[0].index_select(0, &x[1]),
        ),
        case("masked_fill", &[(&[5, 7], F), (&[7], F)], 1.0, |x| {
            x[0].masked_fill(&x[1].unary(Relu)?, -2.5)
        }),
        case(
            "where",
            &[(&[5, 7], F), (&[5, 7], F), (&[5, 7], F)],
            1.0,
            |x| Tensor::where_cond(&x[0].unary(Relu)?, &x[1], &x[2]),
        ),
        case("triu", &[(&[5, 7], F)], 1.0, |x| x[0].triu(1)),
        case("rotary", &[(&[2, 6, 8], F)], 1.0, |x| {
            x[0].rotary(1, 10000.0)
        }),
        case("dropout", &[(&[5, 7], F)], 1.0, |x| x[0].dropout(0.3, 11)),
        case("transpose", &[(&[5, 7], F)], 1.0, |x| x[0].transpose(0, 1)),
        case("permute", &[(&[2, 3, 4], F)], 1.0, |x| {
            x[0].permute(&[2, 0, 1])
        }),
        case("reshape", &[(&[5, 6], F)], 1.0, |x| x[0].reshape([3, 10])),
        case("narrow", &[(&[5, 7], F)], 1.0, |x| x[0].narrow(1, 2, 4)),
        case("concat", &[(&[5, 7], F), (&[5, 2], F)], 1.0, |x| {
            Tensor::concat(&[&x[0], &x[1]], 1)
        }),
        case("to_f32", &[(&[5, 7], F)], 0.0, |x| {
            x[0].to_dtype(DType::F32)
        }),
        case(
            "scatter_add",
            &[(&[4, 3], Input::Ids(6)), (&[4, 3], F)],
            1.0,
            |x| Tensor::scatter_add(&x[0], &x[1], 0, 6),
        ),
        case(
            "index_add",
            &[(&[5], Input::Ids(3)), (&[5, 4], F)],
            1.0,
            |x| Tensor::index_add(&x[0], &x[1], 0, 3),
        ),
    ];
    // Backward kernels, through autograd (each gradient rounds after each 16-bit step).
    v.extend([
        case("grad_gelu", &[(&[5, 7], F)], 4.0, |x| {
            grad_of(&x[0], |t| t.gelu())
        }),
        case("grad_softmax", &[(&[4, 30], F)], 4.0, |x| {
            grad_of(&x[0], |t| t.softmax(1))
        }),
        case("grad_log_softmax", &[(&[4, 30], F)], 4.0, |x| {
            grad_of(&x[0], |t| t.log_softmax(1))
        }),
        case(
            "grad_layer_norm",
            &[(&[4, 24], F), (&[24], F), (&[24], F)],
            8.0,
            |x| {
                let (w, b) = (x[1].clone(), x[2].clone());
                grad_of(&x[0], move |t| t.layer_norm(&w, &b, 1e-5))
            },
        ),
        case("grad_rms_norm", &[(&[4, 24], F), (&[24], F)], 8.0, |x| {
            let w = x[1].clone();
            grad_of(&x[0], move |t| t.rms_norm(&w, 1e-5))
        }),
        case(
            "grad_cross_entropy",
            &[(&[6, 11], F), (&[6], Input::Ids(11))],
            4.0,
            |x| {
                let l = x[1].clone();
                grad_of(&x[0], move |t| t.cross_entropy(&l))
            },
        ),
        case(
            "grad_embedding",
            &[(&[9, 5], F), (&[7], Input::Ids(9))],
            4.0,
            |x| {
                let ids = x[1].clone();
                grad_of(&x[0], move |t| Tensor::embedding(&ids, t))
            },
        ),
        case("grad_matmul", &[(&[6, 9], F), (&[9, 5], F)], 4.0, |x| {
            let w = x[1].clone();
            grad_of(&x[0], move |t| t.matmul(&w))
        }),
        case(
            "grad_flash_attention_q",
            &[(&[1, 6, 2, 8], F), (&[1, 6, 2, 8], F), (&[1, 6, 2, 8], F)],
            16.0,
            |x| {
                let (k, v) = (x[1].clone(), x[2].clone());
                grad_of(&x[0], move |t| flash_attention(t, &k, &v, true, 0.35))
            },
        ),
        case(
            "grad_flash_attention_k",
            &[(&[1, 6, 2, 8], F), (&[1, 6, 2, 8], F), (&[1, 6, 2, 8], F)],
            16.0,
            |x| {
                let (q, v) = (x[0].clone(), x[2].clone());
                grad_of(&x[1], move |t| flash_attention(&q, t, &v, true, 0.35))
            },
        ),
        case(
            "grad_flash_attention_v",
            &[(&[1, 6, 2, 8], F), (&[1, 6, 2, 8], F), (&[1, 6, 2, 8], F)],
            16.0,
            |x| {
                let (q, k) = (x[0].clone(), x[1].clone());
                grad_of(&x[2], move |t| flash_attention(&q, &k, t, true, 0.35))
            },
        ),
        case("grad_rotary", &[(&[2, 6, 8], F)], 4.0, |x| {
            grad_of(&x[0], |t| t.rotary(1, 10000.0))
        }),
        case("grad_dropout", &[(&[5, 7], F)], 4.0, |x| {
            grad_of(&x[0], |t| t.dropout(0.3, 11))
        }),
        case("grad_to_dtype", &[(&[5, 7], F)], 2.0, |x| {
            grad_of(&x[0], |t| t.to_dtype(DType::F32)?.square())
        }),
    ]);
    v.extend(fused_cases());
    v
}

/// The fused custom ops (residual LayerNorm, linear with its epilogues, the classifier),
/// forward and backward. Their sums and pre-activations round to 16 bits before the step that
/// reads them, as the composed ops would.
fn fused_cases() -> Vec<HalfCase> {
    use oxiflow_ops::linear::Activation::{Gelu, None as Plain};
    let rln = [(&[4, 24][..], F), (&[4, 24], F), (&[24], F), (&[24], F)];
    let lin = [(&[2, 3, 16][..], F), (&[16, 8], F), (&[8], F)];
    let cls = [(&[6, 11][..], F), (&[6], Input::Ids(11))];
    // Padded classes: 11 of 16 columns (16-byte rows) and 9 of 13 (unaligned rows).
    let pad16 = [(&[6, 16][..], F), (&[6], Input::Ids(11))];
    let pad13 = [(&[5, 13][..], F), (&[5], Input::Ids(9))];
    vec![
        case("residual_layer_norm", &rln, 4.0, |x| {
            Ok(residual_layer_norm(&x[0], &x[1], &x[2], &x[3], 1e-5)?.1)
        }),
        case("residual_layer_norm_sum", &rln, 1.0, |x| {
            Ok(residual_layer_norm(&x[0], &x[1], &x[2], &x[3], 1e-5)?.0)
        }),
        case("grad_residual_layer_norm", &rln, 8.0, |x| {
            let (a, w, b) = (x[1].clone(), x[2].clone(), x[3].clone());
            grad_of(&x[0], move |t| {
                let (r, y) = residual_layer_norm(t, &a, &w, &b, 1e-5)?;
                r.add(&y)
            })
        }),
        case("grad_residual_layer_norm_weight", &rln, 8.0, |x| {
            let (t, a, b) = (x[0].clone(), x[1].clone(), x[3].clone());
            grad_of(&x[2], move |w| {
                Ok(residual_layer_norm(&t, &a, w, &b, 1e-5)?.1)
            })
        }),
        case("linear", &lin, 2.0, |x| {
            linear(&x[0], &x[1], Some(&x[2]), Plain)
        }),
        case("linear_gelu", &lin, 2.0, |x| {
            linear(&x[0], &x[1], Some(&x[2]), Gelu)
        }),
        case("grad_linear_gelu", &lin, 4.0, |x| {
            let (w, b) = (x[1].clone(), x[2].clone());
            grad_of(&x[0], move |t| linear(t, &w, Some(&b), Gelu))
        }),
        case("grad_linear_gelu_weight", &lin, 4.0, |x| {
            let (t, b) = (x[0].clone(), x[2].clone());
            grad_of(&x[1], move |w| linear(&t, w, Some(&b), Gelu))
        }),
        case("grad_linear_bias", &lin, 4.0, |x| {
            let (t, w) = (x[0].clone(), x[1].clone());
            grad_of(&x[2], move |b| linear(&t, &w, Some(b), Plain))
        }),
        case("classifier_loss", &cls, 1.0, |x| {
            classifier_loss(&x[0], &x[1])
        }),
        case("grad_classifier", &cls, 4.0, |x| {
            let l = x[1].clone();
            grad_of(&x[0], move |t| classifier_loss(t, &l))
        }),
        case("classifier_loss_padded", &pad16, 1.0, |x| {
            classifier_loss_padded(&x[0], &x[1], 11)
        }),
        case("grad_classifier_padded", &pad16, 4.0, |x| {
            let l = x[1].clone();
            grad_of(&x[0], move |t| classifier_loss_padded(t, &l, 11))
        }),
        case("classifier_loss_padded_unaligned", &pad13, 1.0, |x| {
            classifier_loss_padded(&x[0], &x[1], 9)
        }),
        case("grad_classifier_padded_unaligned", &pad13, 4.0, |x| {
            let l = x[1].clone();
            grad_of(&x[0], move |t| classifier_loss_padded(t, &l, 9))
        }),
    ]
}

/// The dtype a case's output has on `dtype` inputs (f32 for casts to it and the classifier's
/// loss).
pub fn out_dtype(c: &HalfCase, dtype: DType) -> DType {
    if matches!(
        c.name,
        "to_f32"
            | "classifier_loss"
            | "classifier_loss_padded"
            | "classifier_loss_padded_unaligned"
            | "flash_attention_lse"
    ) {
        DType::F32
    } else {
        dtype
    }
}

/// splitmix64 values for inputs, the same on every rank.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The f64 values of input `i` of a case (a float input's values already rounded to `dtype`,
/// so the f64 reference sees exactly the 16-bit inputs).
pub fn input_values(shape: &[usize], kind: Input, dtype: DType, seed: u64) -> Vec<f64> {
    let mut r = Rng(seed);
    let n: usize = shape.iter().product();
    (0..n)
        .map(|_| match kind {
            Input::Ids(k) => (r.next() % k as u64) as f64,
            Input::Float | Input::Positive => {
                let mag = 0.25 + 1.75 * r.unit();
                let sign = if matches!(kind, Input::Float) && r.next() & 1 == 1 {
                    -1.0
                } else {
                    1.0
                };
                round_to(dtype, sign * mag)
            }
        })
        .collect()
}

/// `v` rounded once to `dtype`.
pub fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::BF16 => oxiflow_tensor::bf16::from_f64(v).to_f64(),
        DType::F16 => oxiflow_tensor::f16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        _ => v,
    }
}

/// The inputs of `c` as local CPU tensors of `dtype` (ids stay i64).
pub fn local_inputs(c: &HalfCase, dtype: DType, seed: u64) -> Result<Vec<Tensor>> {
    c.inputs
        .iter()
        .enumerate()
        .map(|(i, (shape, kind))| {
            let v = input_values(shape, *kind, dtype, seed + i as u64);
            let t = Tensor::from_vec(v, shape.clone())?;
            match kind {
                Input::Ids(_) => t.to_dtype(DType::I64),
                _ => t.to_dtype(dtype),
            }
        })
        .collect()
}

/// The inputs of `c` as broadcast global tensors on `placement`.
pub fn global_inputs(
    c: &HalfCase,
    dtype: DType,
    seed: u64,
    placement: &Placement,
) -> Result<Vec<Tensor>> {
    local_inputs(c, dtype, seed)?
        .into_iter()
        .map(|t| t.to_global(placement, vec![Sbp::B; placement.ndim()]))
        .collect()
}

/// Machine epsilon's half (the largest relative rounding error) of a 16-bit dtype.
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-24),
    }
}

/// Whether `got` is within `ulps` roundings of `want`: relative to each element, plus a floor
/// on the output's scale (f32-level for single kernels, `ulps` roundings for composites).
pub fn within(
    got: &[f64],
    want: &[f64],
    dtype: DType,
    ulps: f64,
) -> std::result::Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} elements, want {}", got.len(), want.len()));
    }
    let scale = want.iter().fold(0f64, |m, w| m.max(w.abs()));
    let u = unit_roundoff(dtype);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        // Composite cases (several 16-bit steps, gradients with cancellation) are held to their
        // roundings of the output's scale; single kernels to f32 error there.
        let floor = if ulps > 1.0 { ulps * u } else { 1e-5 * ulps };
        let tol = ulps * u * w.abs() + floor * scale;
        if !((g - w).abs() <= tol || (g.is_nan() && w.is_nan())) {
            return Err(format!(
                "element {i}: got {g}, want {w} (tolerance {tol:.3e})"
            ));
        }
    }
    Ok(())
}
