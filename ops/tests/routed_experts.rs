//! The routed SwiGLU experts (`routed_experts`) against one rank's composition of the routed
//! product and SwiGLU (`expert_matmul`, `swiglu`) on each expert's slice of the stacked
//! matrices, in f64 within 1e-9: the output and the gradients of the rows and of the gate, up
//! and down matrices, on meshes whose axes split rows and experts (the rows travel to their
//! experts' ranks and back), rows only (data parallel), each expert's hidden columns (tensor
//! parallel) or nothing; uneven expert splits, ranks holding no experts, no rows, or
//! receiving no rows, experts no row reaches; a proptest over all of it; the exchange runs
//! without boxing the experts; f32 and bf16 near the f64 values; typed errors for bad dtypes
//! and shapes.

mod common;

use std::time::Duration;

use common::{close, never_zero, vals};

use oxiflow_ops::moe::expert_matmul;
use oxiflow_ops::moe::routed::routed_experts;
use oxiflow_ops::swiglu::swiglu;
use oxiflow_placement::Placement;
use oxiflow_tensor::explain::{explain_finish, explain_start, ExplainEvent};
use oxiflow_tensor::{run_ranks, DType, DeviceType, NdSbp, Sbp, Tensor, TensorError};
use proptest::prelude::*;

/// What one mesh axis splits.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Axis {
    /// Rows and experts (expert parallel): the rows are exchanged.
    Ep,
    /// Rows only (data parallel).
    Dp,
    /// Each expert's hidden columns (tensor parallel).
    Tp,
    /// Nothing.
    Rep,
}

impl Axis {
    /// The SBPs of x (and ids, and the loss weights), gate, up and down, and of y.
    fn sbps(self) -> [Sbp; 5] {
        let s0 = Sbp::S(0);
        match self {
            Axis::Ep => [s0, s0, s0, s0, s0],
            Axis::Dp => [s0, Sbp::B, Sbp::B, Sbp::B, s0],
            Axis::Tp => [Sbp::B, Sbp::S(2), Sbp::S(2), Sbp::S(1), Sbp::P],
            Axis::Rep => [Sbp::B; 5],
        }
    }
}

/// One case: m rows of width c, `experts` experts of hidden width f, ids from `ids`.
#[derive(Clone, Debug)]
struct Case {
    m: usize,
    c: usize,
    f: usize,
    experts: usize,
    ids: Vec<i64>,
}

impl Case {
    /// Ids drawn from `seed` among the first `reach` experts.
    fn new(m: usize, c: usize, f: usize, experts: usize, reach: usize, seed: u64) -> Case {
        let mut s = seed;
        let ids = (0..m)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as usize % reach.clamp(1, experts)) as i64
            })
            .collect();
        Case {
            m,
            c,
            f,
            experts,
            ids,
        }
    }

    /// x, gate, up, down and the loss weights (random, never zero), in `dtype`.
    fn operands(&self, dtype: DType) -> [Tensor; 5] {
        let (m, c, f, e) = (self.m, self.c, self.f, self.experts);
        let shapes = [
            vec![m, c],
            vec![e, c, f],
            vec![e, c, f],
            vec![e, f, c],
            vec![m, c],
        ];
        let mut i = 0u64;
        shapes.map(|s| {
            i += 1;
            let n = s.iter().product();
            Tensor::from_vec(never_zero(n, 40 + i), s)
                .unwrap()
                .cast(dtype)
                .unwrap()
        })
    }

    fn ids(&self) -> Tensor {
        Tensor::from_vec(self.ids.clone(), [self.m]).unwrap()
    }
}

/// Output, dx, dgate, dup, ddown of `sum(y * w)` on one rank, by the routed product and
/// SwiGLU on each expert's slice.
fn reference(case: &Case) -> [Vec<f64>; 5] {
    let [x, gate, up, down, w] = case.operands(DType::F64);
    let [x, gate, up, down] = [x, gate, up, down].map(|t| t.requires_grad_(true));
    let slices = |t: &Tensor| -> Vec<Tensor> {
        let d = t.shape().dims().to_vec();
        (0..case.experts)
            .map(|e| t.narrow(0, e, 1).unwrap().reshape([d[1], d[2]]).unwrap())
            .collect()
    };
    let ids = case.ids();
    let g = expert_matmul(&x, &ids, &slices(&gate), false).unwrap();
    let u = expert_matmul(&x, &ids, &slices(&up), false).unwrap();
    let h = swiglu(&g, &u).unwrap();
    let y = expert_matmul(&h, &ids, &slices(&down), false).unwrap();
    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    [
        vals(&y),
        vals(&x.grad().unwrap()),
        vals(&gate.grad().unwrap()),
        vals(&up.grad().unwrap()),
        vals(&down.grad().unwrap()),
    ]
}

/// The same on ranks over `mesh` whose axes split as `axes`, in `dtype`: every rank's
/// gathered values, or why it failed.
fn on_ranks(
    case: &Case,
    mesh: &[usize],
    axes: &[Axis],
    dtype: DType,
) -> Vec<Result<[Vec<f64>; 5], String>> {
    let n: usize = mesh.iter().product();
    let p = Placement::new(DeviceType::Cpu, mesh.to_vec(), (0..n).collect::<Vec<_>>()).unwrap();
    let nd = |i: usize| NdSbp::new(axes.iter().map(|a| a.sbps()[i]));
    run_ranks(n, Duration::from_secs(60), |_| {
        let global = |t: &Tensor, nd: NdSbp| {
            t.to_global(&p, NdSbp::broadcast(p.ndim()))
                .and_then(|t| t.to_global(&p, nd))
                .map(|t| t.detach())
                .map_err(|e| e.to_string())
        };
        let [x, gate, up, down, w] = case.operands(dtype);
        let ids = global(&case.ids(), nd(0))?;
        let w = global(&w, nd(0))?;
        let [x, gate, up, down] = [(x, 0), (gate, 1), (up, 2), (down, 3)]
            .map(|(t, i)| global(&t, nd(i)).map(|t| t.requires_grad_(true)));
        let (x, gate, up, down) = (x?, gate?, up?, down?);
        let y = routed_experts(&x, &ids, &gate, &up, &down).map_err(|e| e.to_string())?;
        if y.nd_sbp() != Some(&nd(4)) {
            return Err(format!("y is {:?}, expected {}", y.nd_sbp(), nd(4)));
        }
        y.mul(&w)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .map_err(|e| e.to_string())?;
        let grad = |t: &Tensor| t.grad().map(|g| vals(&g)).ok_or("no gradient");
        Ok([vals(&y), grad(&x)?, grad(&gate)?, grad(&up)?, grad(&down)?])
    })
}

const NAMES: [&str; 5] = ["y", "dx", "dgate", "dup", "ddown"];

/// Asserts every rank's values equal one rank's within `rel` of each tensor's largest value.
fn check(case: &Case, mesh: &[usize], axes: &[Axis], dtype: DType, rel: f64) {
    let want = reference(case);
    let what = format!("{case:?} on {mesh:?} as {axes:?} in {dtype}");
    for (rank, got) in on_ranks(case, mesh, axes, dtype).into_iter().enumerate() {
        let got = got.unwrap_or_else(|e| panic!("rank {rank}, {what}: {e}"));
        for ((g, w), name) in got.iter().zip(&want).zip(NAMES) {
            let big = w.iter().fold(1e-3f64, |b, v| b.max(v.abs()));
            let scaled = |v: &[f64]| v.iter().map(|x| x / big).collect::<Vec<_>>();
            close(
                &scaled(g),
                &scaled(w),
                rel,
                &format!("rank {rank} {name}, {what}"),
            );
        }
    }
}

fn f64_check(case: &Case, mesh: &[usize], axes: &[Axis]) {
    check(case, mesh, axes, DType::F64, 1e-9);
}

#[test]
fn ep2_equals_one_rank_without_boxing_the_experts() {
    // A width no other test uses, to find this test's events in the process-wide record.
    let case = Case::new(9, 7, 5, 4, 4, 1);
    explain_start();
    f64_check(&case, &[2], &[Axis::Ep]);
    let record = explain_finish();
    let gate_shape = [case.experts, case.c, case.f];
    let boxed: Vec<_> = record
        .boxings()
        .filter_map(|e| match e {
            ExplainEvent::Boxing { op, from, .. }
                if op.starts_with("routed_experts") && from.shape().dims() == gate_shape =>
            {
                Some(format!("{op}: {from}"))
            }
            _ => None,
        })
        .collect();
    assert!(boxed.is_empty(), "the experts were boxed: {boxed:?}");
}

#[test]
fn ep4_with_ranks_that_receive_no_rows_and_experts_no_row_reaches() {
    // Every row to expert 0 (rank 0): ranks 1..3 receive nothing, experts 1..7 get no row.
    f64_check(&Case::new(10, 3, 4, 8, 1, 2), &[4], &[Axis::Ep]);
    // Three rows over four ranks: one rank sends nothing.
    f64_check(&Case::new(3, 3, 4, 4, 4, 3), &[4], &[Axis::Ep]);
}

#[test]
fn uneven_expert_splits_and_ranks_without_experts_equal_one_rank() {
    // 5 experts over 3 ranks (2, 2, 1); 2 experts over 3 ranks (one rank holds none).
    f64_check(&Case::new(11, 3, 2, 5, 5, 4), &[3], &[Axis::Ep]);
    f64_check(&Case::new(7, 2, 3, 2, 2, 5), &[3], &[Axis::Ep]);
}

#[test]
fn ep_beside_data_and_tensor_parallel_axes_equals_one_rank() {
    f64_check(
        &Case::new(12, 4, 3, 4, 4, 6),
        &[2, 2],
        &[Axis::Dp, Axis::Ep],
    );
    f64_check(
        &Case::new(10, 4, 4, 4, 3, 7),
        &[2, 2],
        &[Axis::Ep, Axis::Tp],
    );
    f64_check(&Case::new(6, 3, 4, 2, 2, 8), &[2, 2], &[Axis::Tp, Axis::Dp]);
}

#[test]
fn f32_and_bf16_on_ranks_are_near_the_f64_values() {
    let case = Case::new(8, 4, 6, 4, 4, 9);
    check(&case, &[2], &[Axis::Ep], DType::F32, 1e-4);
    check(&case, &[2], &[Axis::Ep], DType::BF16, 5e-2);
}

#[test]
fn bad_dtypes_and_shapes_are_typed_errors() {
    let case = Case::new(4, 3, 2, 2, 2, 10);
    let [x, gate, up, down, _] = case.operands(DType::F64);
    let float_ids = case.ids().cast(DType::F64).unwrap();
    match routed_experts(&x, &float_ids, &gate, &up, &down) {
        Err(TensorError::DType { op, .. }) => assert_eq!(op, "routed_experts"),
        other => panic!("float ids: {other:?}"),
    }
    match routed_experts(&x, &case.ids(), &gate, &up, &gate) {
        Err(e @ TensorError::Shape { .. }) => {
            assert!(e.to_string().contains("routed_experts"), "{e}")
        }
        other => panic!("down shaped like gate: {other:?}"),
    }
    let out_of_range = Tensor::from_vec(vec![0i64, 1, 2, 0], [4]).unwrap();
    let e = routed_experts(&x, &out_of_range, &gate, &up, &down).unwrap_err();
    assert!(e.to_string().contains("expert 2 of 2"), "{e}");
}

/// The meshes of the proptest: sizes and what each axis splits.
fn layouts() -> impl Strategy<Value = (Vec<usize>, Vec<Axis>)> {
    prop_oneof![
        (1usize..=4).prop_map(|n| (vec![n], vec![Axis::Ep])),
        Just((vec![2, 2], vec![Axis::Dp, Axis::Ep])),
        Just((vec![2, 3], vec![Axis::Dp, Axis::Ep])),
        Just((vec![2, 2], vec![Axis::Ep, Axis::Tp])),
        Just((vec![3, 2], vec![Axis::Ep, Axis::Rep])),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn any_split_of_rows_and_experts_equals_one_rank(
        (mesh, axes) in layouts(),
        m in 1usize..12,
        c in 1usize..4,
        f in 1usize..5,
        experts in 1usize..7,
        reach in 1usize..7,
        seed in any::<u64>(),
    ) {
        f64_check(&Case::new(m, c, f, experts, reach, seed), &mesh, &axes);
    }
}
