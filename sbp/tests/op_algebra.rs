//! For every rule builder (called through the tests' `RuleCall`): every signature the engine returns, and every candidate it considered,
//! applied by the reference interpreter on plain arrays (pieces materialised per rank, the op
//! run on each rank's pieces, the output reassembled from its nd-SBP) gives the op's value on
//! the whole arrays. Also: the chosen signature is a candidate of least input-boxing cost.

mod reference;

use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{inference_cost, BinaryOp, GlobalLayout, NdSbp, ReduceKind, Shape};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use reference::op::{candidates, infer, Dims, RuleCall};
use reference::{check_signature, nd_of, shape_of, Arr};

const MESHES: &[&[usize]] = &[
    &[1],
    &[2],
    &[3],
    &[4],
    &[2, 2],
    &[2, 3],
    &[3, 2],
    &[1, 2],
    &[2, 2, 2],
    &[1, 2, 2],
    &[2, 1, 3],
];
const KINDS: usize = 32;
static CHECKED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct Case {
    op: RuleCall,
    inputs: Vec<Arr>,
}

fn vals(shape: &[usize], seed: u64) -> Arr {
    Arr::random(shape, seed, -2.0, 2.0)
}

/// A shape derived from `out` for a broadcasting operand: leading dims dropped, some set to 1.
fn bcast_operand(out: &[usize], drop: usize, ones: usize) -> Vec<usize> {
    out[drop.min(out.len())..]
        .iter()
        .enumerate()
        .map(|(i, &n)| if ones >> i & 1 == 1 { 1 } else { n })
        .collect()
}

/// A random permutation of 0..n from random numbers.
fn perm_of(n: usize, r: &[usize]) -> Dims {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        v.swap(i, r[i] % (i + 1));
    }
    v.into_iter().collect()
}

/// A reshape target: merge two adjacent dims, split one dim into factors, or add/remove 1s.
fn reshape_target(x: &[usize], r: &[usize]) -> Vec<usize> {
    let mut t = x.to_vec();
    for step in 0..1 + r[0] % 2 {
        let c = r[1 + step];
        match c % 4 {
            0 if t.len() >= 2 => {
                let i = c / 4 % (t.len() - 1);
                let m = t[i] * t[i + 1];
                t.splice(i..i + 2, [m]);
            }
            1 if !t.is_empty() => {
                let i = c / 4 % t.len();
                let n = t[i];
                let f = (2..=n)
                    .find(|f| n.is_multiple_of(*f) && (c / 16).is_multiple_of(2))
                    .unwrap_or(1);
                t.splice(i..i + 1, [f, n / f.max(1)]);
            }
            2 => {
                let i = c / 4 % (t.len() + 1);
                t.insert(i, 1);
            }
            _ => {
                if let Some(i) = t.iter().position(|&n| n == 1) {
                    t.remove(i);
                } else if t.len() >= 2 {
                    let n = t.pop().unwrap_or(1);
                    if let Some(l) = t.last_mut() {
                        *l *= n;
                    }
                }
            }
        }
    }
    t
}

fn build(kind: usize, d: &[usize], r: &[usize], seed: u64) -> Case {
    let n = 1 + r[0] % 3;
    let x = d[..n].to_vec();
    let c = |op, inputs| Case { op, inputs };
    match kind {
        0 => c(
            RuleCall::MatMul,
            vec![vals(&[d[0], d[1]], seed), vals(&[d[1], d[2]], seed + 1)],
        ),
        1 => {
            let (a, b) = if r[1].is_multiple_of(2) {
                (vec![d[0], d[1], d[2]], vec![d[0], d[2], d[3]])
            } else {
                (vec![d[0], d[4], d[1], d[2]], vec![d[0], d[4], d[2], d[3]])
            };
            c(
                RuleCall::BatchMatMul,
                vec![vals(&a, seed), vals(&b, seed + 1)],
            )
        }
        2 | 3 => c(RuleCall::Unary { linear: kind == 2 }, vec![vals(&x, seed)]),
        4..=7 => {
            let op = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div][kind - 4];
            let a = bcast_operand(&x, r[1] % 2, (r[2] % 8) & (r[3] % 8));
            let b = bcast_operand(&x, r[4] % (n + 1), r[5] % 8);
            let bv = if op == BinaryOp::Div {
                Arr::random(&b, seed + 1, 0.5, 2.0)
            } else {
                vals(&b, seed + 1)
            };
            c(RuleCall::Binary(op), vec![vals(&a, seed), bv])
        }
        8..=11 => {
            let kind = [
                ReduceKind::Sum,
                ReduceKind::Mean,
                ReduceKind::Max,
                ReduceKind::Min,
            ][kind - 8];
            let mut dims: Dims = (0..n).filter(|i| r[1] >> i & 1 == 1).collect();
            if dims.is_empty() {
                dims.push(r[2] % n);
            }
            c(
                RuleCall::Reduce {
                    kind,
                    dims,
                    keepdim: r[3] % 2 == 1,
                },
                vec![vals(&x, seed)],
            )
        }
        12 => {
            let target = bcast_operand(&x, r[1] % (n + 1), r[2] % 8);
            c(
                RuleCall::ReduceToShape {
                    shape: Shape::from(target),
                },
                vec![vals(&x, seed)],
            )
        }
        13 => {
            let src = bcast_operand(&x, r[1] % (n + 1), r[2] % 8);
            c(
                RuleCall::BroadcastTo {
                    shape: Shape::from(x.clone()),
                },
                vec![vals(&src, seed)],
            )
        }
        14 => c(RuleCall::Softmax { dim: r[1] % n }, vec![vals(&x, seed)]),
        15 => c(RuleCall::LogSoftmax { dim: r[1] % n }, vec![vals(&x, seed)]),
        16 => c(
            RuleCall::SoftmaxBackward { dim: r[1] % n },
            vec![vals(&x, seed), vals(&x, seed + 1)],
        ),
        17 => c(
            RuleCall::LogSoftmaxBackward { dim: r[1] % n },
            vec![vals(&x, seed), vals(&x, seed + 1)],
        ),
        18 => c(
            RuleCall::Permute {
                perm: perm_of(n, &r[1..]),
            },
            vec![vals(&x, seed)],
        ),
        19 => {
            let x = d[..1 + r[0] % 4].to_vec();
            let t = reshape_target(&x, &r[1..]);
            c(
                RuleCall::Reshape {
                    shape: Shape::from(t),
                },
                vec![vals(&x, seed)],
            )
        }
        20 => {
            let dim = r[1] % n;
            let k = 1 + r[2] % 3;
            let inputs = (0..k)
                .map(|j| {
                    vals(
                        &{
                            let mut s = x.clone();
                            s[dim] = d[(j + 3) % 8];
                            s
                        },
                        seed + j as u64,
                    )
                })
                .collect();
            c(RuleCall::Concat { dim }, inputs)
        }
        21 => {
            let dim = r[1] % n;
            let end = r[2] % (x[dim] + 1);
            let start = r[3] % (end + 1);
            c(RuleCall::Slice { dim, start, end }, vec![vals(&x, seed)])
        }
        22 | 23 => {
            let v = 1 + d[0];
            let ids_shape = d[2..2 + r[1] % 3].to_vec();
            let ids = Arr::random_ints(&ids_shape, seed, v);
            if kind == 22 {
                c(RuleCall::Embedding, vec![ids, vals(&[v, d[1]], seed + 1)])
            } else {
                let mut dy = ids_shape.clone();
                dy.push(d[1]);
                c(
                    RuleCall::EmbeddingBackward {
                        num_embeddings: v,
                        vocab_split: r[2] % 2 == 1,
                    },
                    vec![ids, vals(&dy, seed + 1)],
                )
            }
        }
        24 | 25 => {
            let k = 1 + r[1] % n;
            let w = x[n - k..].to_vec();
            if kind == 24 {
                let op = RuleCall::LayerNorm { normalized_dims: k };
                c(
                    op,
                    vec![vals(&x, seed), vals(&w, seed + 1), vals(&w, seed + 2)],
                )
            } else {
                // dy, and the per-row mean and (positive) rstd of the forward.
                let stats: Vec<usize> = (0..n).map(|i| if i < n - k { x[i] } else { 1 }).collect();
                let rstd = vals(&stats, seed + 4).map(|v| 0.5 + v * v);
                let op = RuleCall::LayerNormBackward { normalized_dims: k };
                c(
                    op,
                    vec![
                        vals(&x, seed),
                        vals(&w, seed + 1),
                        vals(&x, seed + 2),
                        vals(&stats, seed + 3),
                        rstd,
                    ],
                )
            }
        }
        28..=31 => {
            // Gather, index-select and their scatter-adds along `dim` of x, with `extent`
            // positions there and `k` indices.
            let dim = r[1] % n;
            let (extent, k) = (1 + d[n % 8], 1 + d[(n + 1) % 8]);
            let mut xs = x.clone();
            xs[dim] = extent;
            let mut is = x.clone();
            is[dim] = k;
            let split_first = r[2] % 2 == 1;
            match kind {
                28 => c(
                    RuleCall::Gather { dim },
                    vec![vals(&xs, seed), Arr::random_ints(&is, seed + 1, extent)],
                ),
                29 => c(
                    RuleCall::IndexSelect { dim },
                    vec![vals(&xs, seed), Arr::random_ints(&[k], seed + 1, extent)],
                ),
                30 => c(
                    RuleCall::ScatterAdd {
                        dim,
                        size: extent,
                        split_first,
                    },
                    vec![Arr::random_ints(&is, seed + 1, extent), vals(&is, seed)],
                ),
                _ => c(
                    RuleCall::IndexAdd {
                        dim,
                        size: extent,
                        split_first,
                    },
                    vec![Arr::random_ints(&[k], seed + 1, extent), vals(&is, seed)],
                ),
            }
        }
        _ => {
            let classes = 1 + d[1];
            let logits = vals(&[d[0], classes], seed);
            let labels = Arr::random_ints(&[d[0]], seed + 1, classes);
            if kind == 26 {
                c(RuleCall::CrossEntropy, vec![logits, labels])
            } else {
                c(
                    RuleCall::CrossEntropyBackward,
                    vec![logits, labels, vals(&[d[0]], seed + 2)],
                )
            }
        }
    }
}

fn check_case(
    kind: usize,
    d: &[usize],
    r: &[usize],
    mesh_idx: usize,
    pick: &[usize],
    seed: u64,
) -> Result<(), TestCaseError> {
    let case = build(kind, d, r, seed);
    let mesh = MESHES[mesh_idx];
    let n: usize = mesh.iter().product();
    let placement = Placement::new(
        DeviceType::Cpu,
        mesh.to_vec(),
        (0..n).rev().collect::<Vec<_>>(),
    )
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let shapes: Vec<Shape> = case.inputs.iter().map(shape_of).collect();
    let current: Vec<NdSbp> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| nd_of(s.ndim(), &pick[i * 3..i * 3 + mesh.len()]))
        .collect();
    let inputs: Vec<(&Shape, &NdSbp)> = shapes.iter().zip(&current).collect();
    let sig = infer(&case.op, &inputs, &placement, 4)
        .map_err(|e| TestCaseError::fail(format!("{} on {shapes:?}: {e}", case.op)))?;
    let again =
        infer(&case.op, &inputs, &placement, 4).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(&sig, &again, "the choice is a function of its inputs");
    let shape_refs: Vec<&Shape> = shapes.iter().collect();
    let cands = candidates(&case.op, &shape_refs, &placement)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let layouts: Vec<GlobalLayout> = shapes
        .iter()
        .zip(&current)
        .map(|(s, nd)| GlobalLayout::new(s.clone(), &placement, nd.clone()))
        .collect::<Result<_, _>>()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let cost_of = |ins: &[NdSbp]| -> u64 {
        layouts
            .iter()
            .zip(ins)
            .map(|(l, to)| inference_cost(l, to, 4))
            .sum()
    };
    // The chosen signature is the first candidate of least (cost, boxed input axes).
    let steps_of = |ins: &[NdSbp]| -> usize {
        current
            .iter()
            .zip(ins)
            .map(|(f, t)| f.iter().zip(t.iter()).filter(|(a, b)| a != b).count())
            .sum()
    };
    let best = cands
        .iter()
        .min_by_key(|c| (cost_of(&c.inputs), steps_of(&c.inputs)))
        .ok_or_else(|| TestCaseError::fail("no candidates"))?;
    prop_assert!(
        best.inputs == sig.inputs && best.outputs == sig.outputs,
        "chose {sig}, expected {best}"
    );
    prop_assert_eq!(sig.cost, cost_of(&sig.inputs));
    let all_b = NdSbp::broadcast(mesh.len());
    prop_assert!(
        cands
            .iter()
            .any(|c| c.inputs.iter().chain(&c.outputs).all(|x| *x == all_b)),
        "all-B missing"
    );
    CHECKED.fetch_add(cands.len(), std::sync::atomic::Ordering::Relaxed);
    for c in &cands {
        prop_assert!(
            cost_of(&c.inputs) >= sig.cost,
            "candidate {c} is cheaper than the chosen {sig}"
        );
        check_signature(&case.op, &case.inputs, &placement, c, seed).map_err(|e| {
            TestCaseError::fail(format!("{} on {shapes:?}, mesh {mesh:?}: {e}", case.op))
        })?;
    }
    Ok(())
}

#[test]
fn every_op_kind_every_candidate_matches_the_whole_array() {
    for kind in 0..KINDS {
        let cases = if kind == 19 { 512 } else { 128 };
        let mut runner = TestRunner::new(Config::with_cases(cases));
        let strategy = (
            proptest::collection::vec(0usize..=5, 8),
            proptest::collection::vec(0usize..1000, 8),
            0..MESHES.len(),
            proptest::collection::vec(0usize..100, 15),
            any::<u64>(),
        );
        let result = runner.run(&strategy, |(d, r, m, pick, seed)| {
            check_case(kind, &d, &r, m, &pick, seed)
        });
        if let Err(e) = result {
            panic!("op kind {kind}: {e}");
        }
        eprintln!(
            "op kind {kind}: {} candidate signatures checked so far",
            CHECKED.load(std::sync::atomic::Ordering::Relaxed)
        );
    }
}
