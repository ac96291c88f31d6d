//! Every invalid placement, SBP, layout or op call gives a typed error whose message names the
//! offending value.

mod reference;

use oxiflow_placement::{DeviceType, Placement, PlacementError};
use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceKind, Sbp, SbpError, Shape};
use reference::op::{infer, RuleCall};

fn contains_all(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error message {msg:?} does not name {p:?}");
    }
}

#[test]
fn invalid_placements() {
    let cases: Vec<(Result<Placement, PlacementError>, &[&str])> = vec![
        // Duplicate ranks, built and parsed.
        (
            Placement::new_1d(DeviceType::Cpu, [0, 1, 1]),
            &["rank 1", "[0, 1, 1]"],
        ),
        ("cuda:[[0, 1], [2, 0]]".parse(), &["rank 0", "[0, 1, 2, 0]"]),
        // Empty meshes.
        (
            Placement::new(DeviceType::Cpu, [0], []),
            &["empty mesh", "[0]"],
        ),
        (
            Placement::new(DeviceType::Cpu, Vec::<usize>::new(), []),
            &["empty mesh", "[]"],
        ),
        (
            Placement::new(DeviceType::Cpu, [2, 0], []),
            &["empty mesh", "[2, 0]"],
        ),
        ("cpu:[]".parse(), &["empty mesh"]),
        // Ragged nested lists.
        (
            "cpu:[[0, 1], [2]]".parse(),
            &["ragged", "cpu:[[0, 1], [2]]", "1 items"],
        ),
        ("cpu:[0, [1]]".parse(), &["ragged", "cpu:[0, [1]]"]),
        (
            "cpu:[[0], 1]".parse(),
            &["ragged", "cpu:[[0], 1]", "rank 1"],
        ),
        // Mesh shape and rank count disagree.
        (
            Placement::new(DeviceType::Cpu, [2, 2], [0, 1, 2]),
            &["[2, 2]", "[0, 1, 2]", "4 ranks"],
        ),
        // Unknown device and unparsable text.
        ("tpu:[0]".parse(), &["\"tpu\""]),
        ("cpu:[0, x]".parse(), &["cpu:[0, x]", "byte 8"]),
        ("cpu[0]".parse(), &["cpu[0]"]),
    ];
    for (i, (result, parts)) in cases.into_iter().enumerate() {
        match result {
            Ok(p) => panic!("case {i}: expected an error, got {p}"),
            Err(e) => contains_all(&e.to_string(), parts),
        }
    }
}

#[test]
fn rank_outside_the_world() {
    let p = Placement::new_1d(DeviceType::Cuda, [0, 3]).unwrap();
    let e = p.check_world(3).unwrap_err();
    assert!(matches!(
        e,
        PlacementError::RankOutsideWorld {
            rank: 3,
            world_size: 3,
            ..
        }
    ));
    contains_all(&e.to_string(), &["rank 3", "cuda:[0, 3]", "3 ranks"]);
    assert!(p.check_world(4).is_ok());
}

#[test]
fn invalid_sbp_text() {
    for (text, parts) in [
        ("S(x)", &["\"S(x)\"", "split dim"][..]),
        ("S(-1)", &["\"S(-1)\""]),
        ("Q", &["\"Q\""]),
        ("P(avg)", &["\"P(avg)\""]),
        ("", &["\"\""]),
    ] {
        let e = text.parse::<Sbp>().unwrap_err();
        assert!(matches!(e, SbpError::Parse { .. }));
        contains_all(&e.to_string(), parts);
    }
    for (text, parts) in [
        ("(S(0), X)", &["\"(S(0), X)\""][..]),
        ("(S(0),, B)", &["\"(S(0),, B)\""]),
    ] {
        let e = text.parse::<NdSbp>().unwrap_err();
        assert!(matches!(e, SbpError::Parse { .. }), "{e}");
        contains_all(&e.to_string(), parts);
    }
}

#[test]
fn invalid_layouts() {
    let p1 = Placement::range(DeviceType::Cpu, 2).unwrap();
    let p2: Placement = "cpu:[[0, 1], [2, 3]]".parse().unwrap();
    // Split dim out of range.
    let e = GlobalLayout::new([4, 4], &p1, Sbp::S(2)).unwrap_err();
    assert!(matches!(
        e,
        SbpError::SplitDimOutOfRange {
            dim: 2,
            ndim: 2,
            ..
        }
    ));
    contains_all(&e.to_string(), &["S(2)", "[4, 4]"]);
    let e = GlobalLayout::new(Shape::scalar(), &p2, [Sbp::B, Sbp::S(0)]).unwrap_err();
    contains_all(&e.to_string(), &["S(0)", "(B, S(0))", "[]"]);
    // Wrong nd length.
    let e = GlobalLayout::new([4], &p2, Sbp::S(0)).unwrap_err();
    assert!(matches!(
        e,
        SbpError::NdLengthMismatch {
            expected: 2,
            got: 1,
            ..
        }
    ));
    contains_all(
        &e.to_string(),
        &["S(0)", "cpu:[[0, 1], [2, 3]]", "2 mesh axes"],
    );
    let e = GlobalLayout::new([4], &p1, [Sbp::B, Sbp::B, Sbp::P]).unwrap_err();
    contains_all(&e.to_string(), &["(B, B, P)", "cpu:[0, 1]"]);
}

#[test]
fn invalid_op_calls() {
    let p = Placement::range(DeviceType::Cpu, 2).unwrap();
    let b = NdSbp::from(Sbp::B);
    let s0 = NdSbp::from(Sbp::S(0));
    let (a23, a45, a4, a234) = (
        Shape::from([2, 3]),
        Shape::from([4, 5]),
        Shape::from([4]),
        Shape::from([2, 3, 4]),
    );
    let call = |op: RuleCall, inputs: &[(&Shape, &NdSbp)]| infer(&op, inputs, &p, 4).unwrap_err();
    let cases: Vec<(SbpError, &[&str])> = vec![
        (
            call(RuleCall::MatMul, &[(&a23, &s0), (&a45, &b)]),
            &["matmul", "[2, 3]", "[4, 5]", "S(0), B", "cpu:[0, 1]"],
        ),
        (
            call(RuleCall::MatMul, &[(&a23, &s0)]),
            &["matmul", "takes 2 inputs, got 1"],
        ),
        (
            call(RuleCall::BatchMatMul, &[(&a234, &b), (&a234, &b)]),
            &["batch_matmul", "[2, 3, 4]"],
        ),
        (
            call(
                RuleCall::Binary(oxiflow_sbp::BinaryOp::Add),
                &[(&a23, &b), (&a45, &b)],
            ),
            &["add", "[2, 3] and [4, 5] do not broadcast"],
        ),
        (
            call(
                RuleCall::Reduce {
                    kind: ReduceKind::Sum,
                    dims: [2].into_iter().collect(),
                    keepdim: false,
                },
                &[(&a23, &b)],
            ),
            &["sum(dims=[2]", "[2, 3]"],
        ),
        (
            call(RuleCall::Softmax { dim: 5 }, &[(&a23, &b)]),
            &["softmax", "dim 5", "[2, 3]"],
        ),
        (
            call(
                RuleCall::Permute {
                    perm: [0, 0].into_iter().collect(),
                },
                &[(&a23, &b)],
            ),
            &["permute", "[0, 0]", "[2, 3]"],
        ),
        (
            call(
                RuleCall::Reshape {
                    shape: Shape::from([5]),
                },
                &[(&a23, &b)],
            ),
            &["reshape", "[2, 3]", "[5]"],
        ),
        (
            call(RuleCall::Concat { dim: 0 }, &[(&a23, &b), (&a45, &b)]),
            &["concat", "[4, 5]", "[2, 3]"],
        ),
        (
            call(
                RuleCall::Slice {
                    dim: 1,
                    start: 2,
                    end: 7,
                },
                &[(&a23, &b)],
            ),
            &["slice", "2..7", "[2, 3]"],
        ),
        (
            call(RuleCall::Embedding, &[(&a4, &b), (&a234, &b)]),
            &["embedding", "[2, 3, 4]"],
        ),
        (
            call(
                RuleCall::LayerNorm { normalized_dims: 1 },
                &[(&a23, &b), (&a4, &b), (&a4, &b)],
            ),
            &["layer_norm", "[4]", "[2, 3]"],
        ),
        (
            call(RuleCall::CrossEntropy, &[(&a23, &b), (&a4, &b)]),
            &["cross_entropy", "[2, 3]", "[4]"],
        ),
        (
            call(
                RuleCall::ReduceToShape {
                    shape: Shape::from([5]),
                },
                &[(&a23, &b)],
            ),
            &["reduce_to_shape", "[5]", "[2, 3]"],
        ),
        (
            call(
                RuleCall::BroadcastTo {
                    shape: Shape::from([4, 5]),
                },
                &[(&a23, &b)],
            ),
            &["broadcast_to", "[2, 3]", "[4, 5]"],
        ),
        // Input nd-SBPs that do not fit: split dim out of range, wrong nd length.
        (
            call(
                RuleCall::Unary { linear: true },
                &[(&a4, &NdSbp::from(Sbp::S(3)))],
            ),
            &["unary", "input 0", "S(3)", "[4]"],
        ),
        (
            call(
                RuleCall::MatMul,
                &[
                    (&a23, &b),
                    (&Shape::from([3, 2]), &NdSbp::new([Sbp::B, Sbp::B])),
                ],
            ),
            &["matmul", "input 1", "(B, B)", "cpu:[0, 1]"],
        ),
    ];
    for (i, (e, parts)) in cases.iter().enumerate() {
        assert!(
            matches!(e, SbpError::Op { .. } | SbpError::Input { .. }),
            "case {i}: {e}"
        );
        contains_all(&e.to_string(), parts);
    }
}
