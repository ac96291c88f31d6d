//! The fused element-wise op on the CPU: a program equals its steps run as unfused ops bit for
//! bit (broadcast bias rows, columns and scalars; 16-bit steps rounded where the unfused ops
//! round; empty tensors; every output of a program writing intermediates too); malformed
//! programs and calls are typed errors naming what is wrong.

mod common;

use std::sync::Arc;

use common::bits;
use oxiflow_tensor::custom::{FusedInstr, FusedProgram, FusedStep};
use oxiflow_tensor::{BinaryOp, DType, F64Bits, ScalarOp, Tensor, TensorError, UnaryOp};

fn at(step: FusedStep, dtype: DType) -> FusedInstr {
    FusedInstr { step, dtype }
}

/// (x [R, C] * col [R, 1] + bias [C]) -> gelu -> * 0.5 -> cast f32 -> exp -> cast back.
fn program(d: DType) -> Arc<FusedProgram> {
    use FusedStep::*;
    Arc::new(
        FusedProgram::new(vec![
            at(Input(0), d),
            at(Input(1), d),
            at(Binary(BinaryOp::Mul, 0, 1), d),
            at(Input(2), d),
            at(Binary(BinaryOp::Add, 2, 3), d),
            at(Unary(UnaryOp::Gelu, 4), d),
            at(Scalar(ScalarOp::Mul, F64Bits::new(0.5), 5), d),
            at(Cast(6), DType::F32),
            at(Unary(UnaryOp::Exp, 7), DType::F32),
            at(Cast(8), d),
        ])
        .unwrap(),
    )
}

fn unfused(x: &Tensor, col: &Tensor, bias: &Tensor) -> Tensor {
    let d = x.dtype();
    x.mul(col)
        .and_then(|t| t.add(bias))
        .and_then(|t| t.gelu())
        .and_then(|t| t.mul_scalar(0.5))
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.exp())
        .and_then(|t| t.to_dtype(d))
        .unwrap()
}

#[test]
fn fused_program_equals_the_unfused_ops_bit_for_bit() {
    for d in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (rows, cols) in [(3usize, 5usize), (0, 4), (300, 257)] {
            let x = Tensor::randn([rows, cols], 1, d);
            let col = Tensor::randn([rows, 1], 2, d);
            let bias = Tensor::randn([cols], 3, d);
            let got =
                Tensor::fused_elementwise(&program(d), &[&x, &col, &bias]).unwrap()[0].clone();
            let want = unfused(&x, &col, &bias);
            assert_eq!(got.shape(), want.shape());
            assert_eq!(got.dtype(), d);
            assert_eq!(bits(&got), bits(&want), "{d} [{rows}, {cols}]");
        }
    }
}

/// Outputs besides the last step: each equals the unfused op's value bit for bit.
#[test]
fn every_output_equals_its_unfused_value() {
    use FusedStep::*;
    for d in [DType::F32, DType::BF16] {
        let p = FusedProgram::with_outputs(
            vec![
                at(Input(0), d),
                at(Unary(UnaryOp::Tanh, 0), d),
                at(Scalar(ScalarOp::Add, F64Bits::new(1.0), 1), d),
                at(Binary(BinaryOp::Mul, 2, 0), d),
            ],
            &[1, 2],
        )
        .map(Arc::new)
        .unwrap();
        let x = Tensor::randn([7, 9], 5, d);
        let got = Tensor::fused_elementwise(&p, &[&x]).unwrap();
        let t = x.tanh().unwrap();
        let a = t.add_scalar(1.0).unwrap();
        let y = a.mul(&x).unwrap();
        let want: Vec<Vec<u64>> = [y, t, a].iter().map(bits).collect();
        assert_eq!(got.iter().map(bits).collect::<Vec<_>>(), want, "{d}");
    }
}

#[test]
fn malformed_programs_are_refused_by_name() {
    use FusedStep::*;
    let f = DType::F32;
    let cases: Vec<(Vec<FusedInstr>, &str)> = vec![
        (vec![], "1 to"),
        (
            vec![at(Input(0), f), at(Unary(UnaryOp::Exp, 1), f)],
            "not an earlier one",
        ),
        (vec![at(Input(0), DType::I64)], "not a float dtype"),
        (
            vec![at(Input(0), f), at(Unary(UnaryOp::Exp, 0), DType::F64)],
            "reads step 0 of f32",
        ),
        (vec![at(Input(0), f), at(Input(0), f)], "read by two steps"),
        (vec![at(Input(1), f)], "input 0 is read by no step"),
    ];
    for (instrs, says) in cases {
        let e = FusedProgram::new(instrs.clone()).unwrap_err();
        assert!(e.contains(says), "{instrs:?}: {e}");
    }
    let two = vec![
        at(Input(0), f),
        at(Unary(UnaryOp::Exp, 0), f),
        at(Unary(UnaryOp::Neg, 1), f),
    ];
    for (more, says) in [
        (&[0usize][..], "not a distinct computed step"),
        (&[2][..], "not a distinct computed step"),
        (&[5][..], "not a distinct computed step"),
        (&[1, 1][..], "not a distinct computed step"),
    ] {
        let e = FusedProgram::with_outputs(two.clone(), more).unwrap_err();
        assert!(e.contains(says), "{more:?}: {e}");
    }
}

#[test]
fn bad_calls_are_typed_errors() {
    let p = program(DType::F32);
    let x = Tensor::randn([3, 5], 1, DType::F32);
    let col = Tensor::randn([3, 1], 2, DType::F32);
    let bias = Tensor::randn([5], 3, DType::F32);
    let wrong_count = Tensor::fused_elementwise(&p, &[&x, &col]).unwrap_err();
    assert!(
        wrong_count.to_string().contains("fused_elementwise"),
        "{wrong_count}"
    );
    let f64_bias = bias.to_dtype(DType::F64).unwrap();
    let wrong_dtype = Tensor::fused_elementwise(&p, &[&x, &col, &f64_bias]).unwrap_err();
    assert!(
        matches!(wrong_dtype, TensorError::DType { .. }),
        "{wrong_dtype}"
    );
    let row = Tensor::randn([4], 4, DType::F32);
    let no_broadcast = Tensor::fused_elementwise(&p, &[&x, &col, &row]).unwrap_err();
    assert!(
        matches!(no_broadcast, TensorError::Shape { .. }),
        "{no_broadcast}"
    );
    assert!(
        no_broadcast.to_string().contains("do not broadcast"),
        "{no_broadcast}"
    );
}
