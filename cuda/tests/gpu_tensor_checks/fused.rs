//! The GPU suite's check of the generated fused element-wise kernels (`FusedElementwise`):
//! programs of unary, backward-of-unary, tensor-scalar and broadcasting binary steps and casts
//! (a bias row, a column and a scalar broadcast to the output; intermediates of a smaller
//! shape) run as one generated kernel on broadcast tensors of a cuda placement, against the same
//! steps as unfused ops in f64 on the CPU, on random never-zero inputs, in f32, bf16 and f16
//! (each step rounded to its dtype on the device, so the tolerance grows with the steps), every
//! output of programs writing intermediates besides their last step; and a second launch gives
//! the same bits.

use super::*;
use crate::half_cases::{input_values, within, Input};
use oxiflow_tensor::custom::{FusedInstr, FusedProgram, FusedStep};
use oxiflow_tensor::{BinaryOp, F64Bits, ScalarOp};
use std::sync::Arc;

/// A program's steps, from the dtype its values have.
type Steps = fn(DType) -> Vec<FusedInstr>;

fn at(step: FusedStep, dtype: DType) -> FusedInstr {
    FusedInstr { step, dtype }
}

fn c(v: f64) -> F64Bits {
    F64Bits::new(v)
}

/// x + b, GELU as its tanh formula, g * sigmoid(g), * 0.5, + x (inputs x [R, C], b [C]).
fn bias_gelu_silu(d: DType) -> Vec<FusedInstr> {
    use FusedStep::*;
    let k = (2.0 / std::f64::consts::PI).sqrt();
    [
        Input(0),
        Input(1),
        Binary(BinaryOp::Add, 0, 1),
        Binary(BinaryOp::Mul, 2, 2),
        Binary(BinaryOp::Mul, 3, 2),
        Scalar(ScalarOp::Mul, c(0.044715), 4),
        Binary(BinaryOp::Add, 5, 2),
        Scalar(ScalarOp::Mul, c(k), 6),
        Unary(UnaryOp::Tanh, 7),
        Scalar(ScalarOp::Add, c(1.0), 8),
        Binary(BinaryOp::Mul, 9, 2),
        Scalar(ScalarOp::Mul, c(0.5), 10),
        Unary(UnaryOp::Sigmoid, 11),
        Binary(BinaryOp::Mul, 11, 12),
        Scalar(ScalarOp::Mul, c(0.5), 13),
        Binary(BinaryOp::Add, 14, 0),
    ]
    .into_iter()
    .map(|s| at(s, d))
    .collect()
}

/// Strided and scalar broadcasts, a [R, 1] intermediate, backward steps (inputs x [R, C],
/// col [R, 1] positive, s [1] positive, dy [R, C]).
fn broadcast_backward(d: DType) -> Vec<FusedInstr> {
    use FusedStep::*;
    [
        Input(0),
        Input(1),
        Input(2),
        Input(3),
        Binary(BinaryOp::Mul, 0, 1),
        Binary(BinaryOp::Div, 4, 2),
        UnaryBackward(UnaryOp::Gelu, 3, 5),
        Binary(BinaryOp::Sub, 6, 0),
        Unary(UnaryOp::Tanh, 7),
        Scalar(ScalarOp::RDiv, c(1.0), 1),
        Unary(UnaryOp::Sqrt, 1),
        Unary(UnaryOp::Log, 1),
        Scalar(ScalarOp::Pow, c(3.0), 10),
        Binary(BinaryOp::Add, 9, 11),
        Binary(BinaryOp::Mul, 8, 13),
        Binary(BinaryOp::Add, 14, 12),
        Unary(UnaryOp::Relu, 15),
        UnaryBackward(UnaryOp::Sigmoid, 16, 8),
        Unary(UnaryOp::Square, 8),
        Scalar(ScalarOp::RSub, c(2.0), 18),
        Unary(UnaryOp::Abs, 17),
        Binary(BinaryOp::Add, 20, 19),
        Unary(UnaryOp::Neg, 21),
        Unary(UnaryOp::Exp, 22),
    ]
    .into_iter()
    .map(|s| at(s, d))
    .collect()
}

/// Casts: x to f32, exp(-x^2), back to the dtype, * x, to f64, * 3, back (input x [R, C]).
fn casts(d: DType) -> Vec<FusedInstr> {
    use FusedStep::*;
    vec![
        at(Input(0), d),
        at(Cast(0), DType::F32),
        at(Unary(UnaryOp::Square, 1), DType::F32),
        at(Unary(UnaryOp::Neg, 2), DType::F32),
        at(Unary(UnaryOp::Exp, 3), DType::F32),
        at(Cast(4), d),
        at(Binary(BinaryOp::Mul, 5, 0), d),
        at(Cast(6), DType::F64),
        at(Scalar(ScalarOp::Mul, c(3.0), 7), DType::F64),
        at(Cast(8), d),
    ]
}

/// Every step of the program run as unfused ops on f64 tensors (casts are exact there).
fn reference(p: &FusedProgram, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let mut v: Vec<Tensor> = Vec::with_capacity(p.instrs().len());
    for ins in p.instrs() {
        let t = match ins.step {
            FusedStep::Input(k) => inputs[k].clone(),
            FusedStep::Unary(u, a) => v[a].unary(u)?,
            FusedStep::UnaryBackward(u, g, x) => v[g].unary_backward(u, &v[x])?,
            FusedStep::Scalar(s, k, a) => {
                let k = k.get();
                match s {
                    ScalarOp::Add => v[a].add_scalar(k)?,
                    ScalarOp::Mul => v[a].mul_scalar(k)?,
                    ScalarOp::RSub => v[a].rsub_scalar(k)?,
                    ScalarOp::RDiv => v[a].rdiv_scalar(k)?,
                    ScalarOp::Pow => v[a].pow_scalar(k)?,
                }
            }
            FusedStep::Binary(b, a, x) => match b {
                BinaryOp::Add => v[a].add(&v[x])?,
                BinaryOp::Sub => v[a].sub(&v[x])?,
                BinaryOp::Mul => v[a].mul(&v[x])?,
                BinaryOp::Div => v[a].div(&v[x])?,
            },
            FusedStep::Cast(a) => v[a].clone(),
        };
        v.push(t);
    }
    Ok(v)
}

/// Runs every (program, shape, dtype) case on broadcast tensors of a 1-d placement of `world`
/// ranks of `dev` against the f64 reference; the number of cases checked.
pub(crate) fn child_fused_elementwise(world: usize, dev: DeviceType) -> Checked {
    let pl = world_placement(world, dev)?;
    // (name, steps, inputs, output steps besides the last).
    type Case<'a> = (&'a str, Steps, &'a [Input], &'a [usize]);
    let cases: [Case; 3] = [
        (
            "bias + GELU formula + silu + residual",
            bias_gelu_silu,
            &[Input::Float, Input::Float],
            &[11, 12],
        ),
        (
            "strided broadcasts and backward steps",
            broadcast_backward,
            &[Input::Float, Input::Positive, Input::Positive, Input::Float],
            &[8],
        ),
        ("casts through f32 and f64", casts, &[Input::Float], &[5]),
    ];
    let mut checked = 0;
    for (rows, cols) in [(37usize, 29usize), (300, 257)] {
        let shapes = [vec![rows, cols], vec![cols], vec![rows, 1], vec![1]];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (k, (name, steps, kinds, more)) in cases.iter().enumerate() {
                let what = format!("fused {name} [{rows}, {cols}] in {dtype}");
                let e = |x: oxiflow_tensor::TensorError| format!("{what}: {x}");
                let program = FusedProgram::with_outputs(steps(dtype), more)
                    .map(Arc::new)
                    .map_err(|x| format!("{what}: {x}"))?;
                // Input shapes: x [R, C], then a bias row, a column, a scalar, dy [R, C].
                let shape_of = |i: usize| match (k, i) {
                    (0, 1) => shapes[1].clone(),
                    (1, 1) => shapes[2].clone(),
                    (1, 2) => shapes[3].clone(),
                    _ => shapes[0].clone(),
                };
                let data: Vec<Vec<f64>> = kinds
                    .iter()
                    .enumerate()
                    .map(|(i, &kind)| {
                        input_values(&shape_of(i), kind, dtype, 90 + 10 * k as u64 + i as u64)
                    })
                    .collect();
                let local = |dt: DType| -> Result<Vec<Tensor>> {
                    data.iter()
                        .enumerate()
                        .map(|(i, v)| Tensor::from_vec(v.clone(), shape_of(i))?.to_dtype(dt))
                        .collect()
                };
                let all = reference(&program, &local(DType::F64).map_err(e)?).map_err(e)?;
                let want: Vec<Vec<f64>> = program
                    .outputs()
                    .iter()
                    .map(|&o| super::values(&all[o]))
                    .collect::<Result<_>>()
                    .map_err(e)?;
                let device: Vec<Tensor> = local(dtype)
                    .and_then(|v| v.iter().map(|t| t.to_global(&pl, vec![Sbp::B])).collect())
                    .map_err(e)?;
                let refs: Vec<&Tensor> = device.iter().collect();
                let run = || -> Result<Vec<Vec<f64>>> {
                    Tensor::fused_elementwise(&program, &refs)?
                        .iter()
                        .map(super::values)
                        .collect()
                };
                let got = run().map_err(e)?;
                let again = run().map_err(e)?;
                let ulps = 4.0 * program.op_count() as f64;
                same_len(&what, "outputs", &got, &want)?;
                for (m, (g, w)) in got.iter().zip(&want).enumerate() {
                    within(g, w, dtype, ulps).map_err(|x| format!("{what}: output {m}: {x}"))?;
                }
                let same = |a: &Vec<f64>, b: &Vec<f64>| {
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                };
                if !got.iter().zip(&again).all(|(a, b)| same(a, b)) {
                    return Err(format!("{what}: a second launch gave other bits"));
                }
                checked += 1;
            }
        }
    }
    Ok(checked)
}
