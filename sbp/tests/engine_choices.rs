//! The choices signature inference makes in the cases the design names (data and tensor
//! parallel matmul, weight gradients coming out P, reductions, uneven reshapes), its tie-breaks,
//! and their determinism.

mod reference;

use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{BinaryOp, NdSbp, ReduceKind, ReduceOp, Sbp, Shape, Signature};
use reference::op::RuleCall;

fn nd(s: &str) -> NdSbp {
    s.parse().unwrap()
}

fn infer(op: RuleCall, inputs: &[(&[usize], &str)], p: &Placement) -> Signature {
    let shapes: Vec<Shape> = inputs.iter().map(|(s, _)| Shape::from(*s)).collect();
    let nds: Vec<NdSbp> = inputs.iter().map(|(_, n)| nd(n)).collect();
    let args: Vec<(&Shape, &NdSbp)> = shapes.iter().zip(&nds).collect();
    reference::op::infer(&op, &args, p, 4).unwrap()
}

/// A matmul input: its dims and its nd-SBP.
type Operand = (&'static [usize], &'static str);

#[test]
fn matmul_choices_follow_the_table() {
    let p = Placement::range(DeviceType::Cuda, 4).unwrap();
    let matmul = |x: Operand, w: Operand| infer(RuleCall::MatMul, &[x, w], &p);
    // (x, weight, the signature chosen, its cost where the case names one)
    let cases: [(Operand, Operand, &str, Option<u64>); 6] = [
        // Data parallel: x S(0), weight B.
        (
            (&[8, 16], "S(0)"),
            (&[16, 4], "B"),
            "S(0), B -> S(0)",
            Some(0),
        ),
        // Tensor parallel: x B, weight S(1).
        ((&[8, 16], "B"), (&[16, 4], "S(1)"), "B, S(1) -> S(1)", None),
        // Weight gradient x^T @ dy with x S(0) (so x^T S(1)) and dy S(0): P, no communication.
        (
            (&[16, 8], "S(1)"),
            (&[8, 4], "S(0)"),
            "S(1), S(0) -> P",
            Some(0),
        ),
        // All B stays all B (the fewest boxed axes wins a tie at 0 bytes).
        ((&[8, 16], "B"), (&[16, 4], "B"), "B, B -> B", None),
        // x S(0) with a split weight: two all-to-alls into the k-split (512 B * 3/16 + 256 B *
        // 3/16 = 144) beat all-gathering the weight (256 B * 3/4 = 192). Only input boxing is
        // priced.
        (
            (&[8, 16], "S(0)"),
            (&[16, 4], "S(1)"),
            "S(1), S(0) -> P",
            Some(144),
        ),
        // With a wide x, all-gathering the weight is the cheaper one.
        (
            (&[64, 16], "S(0)"),
            (&[16, 4], "S(1)"),
            "S(0), B -> S(0)",
            Some(192),
        ),
    ];
    for (x, w, want, cost) in cases {
        let s = matmul(x, w);
        assert_eq!(s.to_string(), want);
        if let Some(cost) = cost {
            assert_eq!(s.cost, cost, "{want}");
        }
    }
    let s = matmul((&[8, 16], "S(0)"), (&[16, 4], "B"));
    assert_eq!(s.output_shapes[0], Shape::from([8, 4]));
}

#[test]
fn two_d_mesh_combines_axes() {
    let p: Placement = "cuda:[[0, 1], [2, 3]]".parse().unwrap();
    let s = infer(
        RuleCall::MatMul,
        &[(&[8, 16], "(S(0), B)"), (&[16, 4], "(B, S(1))")],
        &p,
    );
    assert_eq!(
        (s.to_string().as_str(), s.cost),
        ("(S(0), B), (B, S(1)) -> (S(0), S(1))", 0)
    );
    // Data parallel on axis 0, partial on axis 1.
    let s = infer(
        RuleCall::MatMul,
        &[(&[8, 16], "(S(0), S(1))"), (&[16, 4], "(B, S(0))")],
        &p,
    );
    assert_eq!(s.to_string(), "(S(0), S(1)), (B, S(0)) -> (S(0), P)");
}

#[test]
fn gradients_come_out_partial() {
    let p = Placement::range(DeviceType::Cpu, 2).unwrap();
    let s = infer(
        RuleCall::EmbeddingBackward {
            num_embeddings: 10,
            vocab_split: false,
        },
        &[(&[6], "S(0)"), (&[6, 3], "S(0)")],
        &p,
    );
    assert_eq!(s.to_string(), "S(0), S(0) -> P");
    assert_eq!(s.output_shapes[0], Shape::from([10, 3]));
    // The bias gradient: sum a S(0) [8, 4] down to [4].
    let s = infer(
        RuleCall::ReduceToShape {
            shape: Shape::from([4]),
        },
        &[(&[8, 4], "S(0)")],
        &p,
    );
    assert_eq!(s.to_string(), "S(0) -> P");
    let s = infer(
        RuleCall::LayerNormBackward { normalized_dims: 1 },
        &[
            (&[8, 4], "S(0)"),
            (&[4], "B"),
            (&[8, 4], "S(0)"),
            (&[8, 1], "S(0)"),
            (&[8, 1], "S(0)"),
        ],
        &p,
    );
    assert_eq!(s.to_string(), "S(0), B, S(0), S(0), S(0) -> S(0)");
}

#[test]
fn reductions_and_partial_kinds() {
    let p = Placement::range(DeviceType::Cpu, 3).unwrap();
    let dims = |d: &[usize]| d.iter().copied().collect();
    let max = RuleCall::Reduce {
        kind: ReduceKind::Max,
        dims: dims(&[1]),
        keepdim: false,
    };
    let s = infer(max, &[(&[4, 9], "S(1)")], &p);
    assert_eq!(s.outputs[0], NdSbp::from(Sbp::Partial(ReduceOp::Max)));
    let sum = RuleCall::Reduce {
        kind: ReduceKind::Sum,
        dims: dims(&[0]),
        keepdim: false,
    };
    let s = infer(sum, &[(&[4, 9], "S(1)")], &p);
    assert_eq!(s.to_string(), "S(1) -> S(0)");
    // Adding a B bias to a P(max) value keeps P(max); subtracting it from a B gives P(min).
    let s = infer(
        RuleCall::Binary(BinaryOp::Add),
        &[(&[4], "P(max)"), (&[4], "B")],
        &p,
    );
    assert_eq!(s.to_string(), "P(max), B -> P(max)");
    let s = infer(
        RuleCall::Binary(BinaryOp::Sub),
        &[(&[4], "B"), (&[4], "P(max)")],
        &p,
    );
    assert_eq!(s.to_string(), "B, P(max) -> P(min)");
    // A partial plus a broadcast bias: the bias becomes P (free) rather than all-reducing.
    let s = infer(
        RuleCall::Binary(BinaryOp::Add),
        &[(&[4, 4], "P"), (&[4], "B")],
        &p,
    );
    assert_eq!((s.to_string().as_str(), s.cost), ("P, P -> P", 0));
}

#[test]
fn reshape_keeps_even_splits_and_boxes_uneven_ones() {
    let p = Placement::range(DeviceType::Cpu, 2).unwrap();
    // The signature of reshaping `dims` laid out as `sbp` to `to`.
    let reshape = |dims: &[usize], sbp: &str, to: &[usize]| {
        let shape = Shape::from(to);
        infer(RuleCall::Reshape { shape }, &[(dims, sbp)], &p)
    };
    let cases: [(&[usize], &[usize], &str); 3] = [
        (&[4, 6], &[4, 2, 3], "S(0) -> S(0)"),
        (&[4, 6], &[24], "S(0) -> S(0)"),
        // 5 rows over 2 ranks (3, 2) do not line up with 10 elements over 2 (5, 5): boxed to B.
        (&[5, 2], &[10], "B -> B"),
    ];
    for (dims, to, want) in cases {
        assert_eq!(
            reshape(dims, "S(0)", to).to_string(),
            want,
            "{dims:?} -> {to:?}"
        );
    }
    // Splitting the second dim of a group cannot survive.
    let s = reshape(&[4, 6], "S(1)", &[24]);
    assert_eq!(s.outputs[0], NdSbp::from(Sbp::S(0)));
    assert!(s.cost > 0);
}

#[test]
fn choices_are_deterministic() {
    let p: Placement = "cpu:[[0, 1, 2], [3, 4, 5]]".parse().unwrap();
    let op = RuleCall::Binary(BinaryOp::Mul);
    let args: &[(&[usize], &str)] = &[(&[6, 5], "(S(0), S(1))"), (&[5], "(P, S(0))")];
    let s1 = infer(op.clone(), args, &p);
    assert_eq!(s1, infer(op.clone(), args, &p));
    // The choice is the first cheapest candidate, in the candidates' fixed order.
    let shapes = [Shape::from([6, 5]), Shape::from([5])];
    let refs: Vec<&Shape> = shapes.iter().collect();
    let all = reference::op::candidates(&op, &refs, &p).unwrap();
    assert_eq!(all, reference::op::candidates(&op, &refs, &p).unwrap());
    assert!(all
        .iter()
        .any(|c| c.inputs == s1.inputs && c.outputs == s1.outputs));
    // Costs scale with the element size; the choice here does not depend on it.
    let nds = [nd("(S(0), S(1))"), nd("(P, S(0))")];
    let wide =
        reference::op::infer(&op, &[(&shapes[0], &nds[0]), (&shapes[1], &nds[1])], &p, 8).unwrap();
    assert_eq!((wide.inputs, wide.cost), (s1.inputs.clone(), 2 * s1.cost));
}
