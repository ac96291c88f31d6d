//! Property test of element-wise fusion on the CPU: random DAGs of element-wise ops (unary,
//! backward-of-unary, tensor-scalar and broadcasting binary ops, casts between f32, f64 and
//! bf16) over inputs of shapes [R, C], a bias row [C], a column [R, 1] and a [1] scalar, compiled
//! as a step returning the newest value and up to two earlier ones: with one result every live
//! op fuses into one kernel, and the replay on fresh inputs equals the unfused ops run eagerly,
//! bit for bit (NaN where eager has NaN), whatever the group writes besides its root.

mod common;

use common::bits;
use oxiflow_compile::{CompileError, CompiledStep, StepRun};
use oxiflow_dtype::DType;
use oxiflow_tensor::{Tensor, UnaryOp};
use proptest::prelude::*;

const UNARY: [UnaryOp; 10] = [
    UnaryOp::Neg,
    UnaryOp::Relu,
    UnaryOp::Gelu,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Sqrt,
    UnaryOp::Abs,
    UnaryOp::Square,
];
const DTYPES: [DType; 3] = [DType::F32, DType::F64, DType::BF16];
const CONSTANTS: [f64; 5] = [0.5, -1.25, 3.0, 1e-3, 2.0];

/// One op: kind, two operand picks (indices back from the newest value), a constant pick.
type OpSpec = (u8, u8, u8, u8);

/// Operand `pick` of `pool`: mostly the newest values, so chains form.
fn operand(pool: &[Tensor], pick: u8) -> &Tensor {
    let back = (pick as usize % 5).min(pool.len() - 1);
    &pool[pool.len() - 1 - back]
}

/// Runs `ops` on `inputs`; the results are the newest value and the values `extra` picks.
fn build(ops: &[OpSpec], inputs: &[Tensor], extra: &[u8]) -> oxiflow_compile::Result<Vec<Tensor>> {
    let mut pool: Vec<Tensor> = inputs.to_vec();
    for &(kind, a, b, c) in ops {
        let x = operand(&pool, a).clone();
        let y = operand(&pool, b).to_dtype(x.dtype())?;
        let k = CONSTANTS[c as usize % CONSTANTS.len()];
        let next = match kind % 12 {
            0 | 1 => x.unary(UNARY[c as usize % UNARY.len()])?,
            2 if x.shape() == y.shape() => x.unary_backward(UNARY[c as usize % UNARY.len()], &y)?,
            2 | 3 => x.add(&y)?,
            4 => x.sub(&y)?,
            5 => x.mul(&y)?,
            6 => x.div(&y)?,
            7 => x.mul_scalar(k)?,
            8 => x.add_scalar(k)?,
            9 => [x.rsub_scalar(k)?, x.rdiv_scalar(k)?][c as usize % 2].clone(),
            10 => x.pow_scalar([2.0, 0.5, 3.0][c as usize % 3])?,
            _ => x.to_dtype(DTYPES[c as usize % DTYPES.len()])?,
        };
        pool.push(next);
    }
    let mut out: Vec<Tensor> = pool.last().cloned().into_iter().collect();
    out.extend(extra.iter().map(|&e| operand(&pool, e).clone()));
    Ok(out)
}

/// The step's inputs: [R, C], a bias row [C], a column [R, 1] and a [1] scalar, of one dtype.
#[derive(Clone, Copy, Debug)]
struct Inputs {
    rows: usize,
    cols: usize,
    dtype: DType,
}

/// Inputs of 1 to 4 rows, 1 to 5 columns and each of [`DTYPES`].
fn inputs() -> impl Strategy<Value = Inputs> {
    (1usize..5, 1usize..6, prop::sample::select(DTYPES.to_vec()))
        .prop_map(|(rows, cols, dtype)| Inputs { rows, cols, dtype })
}

impl Inputs {
    /// Random values of the inputs, drawn from `seed`.
    fn values(&self, seed: u64) -> Vec<Tensor> {
        let Inputs { rows, cols, dtype } = *self;
        let shapes: [Vec<usize>; 4] = [vec![rows, cols], vec![cols], vec![rows, 1], vec![1]];
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| Tensor::randn(s.clone(), seed * 7 + i as u64, dtype))
            .collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn fused_chains_equal_the_unfused_ops(
        spec in inputs(),
        ops in prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()), 1..14),
        seed in 1u64..1000,
        extra in prop::collection::vec(any::<u8>(), 0..3),
    ) {
        let first = spec.values(seed);
        let mut compiled = CompiledStep::new();
        let (_, run) = compiled.run(&first, || build(&ops, &first, &extra)).unwrap();
        let StepRun::Compiled(c) = run else { panic!("compiles") };
        let r = &c.report;
        let live = c.program.kernel_count() + r.fusion.ops_fused - r.fusion.groups;
        // Every live op is element-wise and read only by live ops: one group of them all (with
        // more step outputs, those of the root's shape are written by the group too).
        if extra.is_empty() && live >= 2 {
            prop_assert_eq!((r.fusion.groups, r.fusion.ops_fused, r.kernels), (1, live, 1), "{:?}", r);
        } else if live < 2 {
            prop_assert_eq!(r.fusion.groups, 0);
        }
        let fresh = spec.values(seed + 1);
        let eager = build(&ops, &fresh, &extra).unwrap();
        let (got, run) = compiled
            .run::<CompileError, _>(&fresh, || panic!("a replay does not run the step"))
            .unwrap();
        prop_assert!(matches!(run, StepRun::Replayed));
        prop_assert_eq!(got.len(), eager.len());
        for (g, e) in got.iter().zip(&eager) {
            prop_assert_eq!(g.shape(), e.shape());
            prop_assert_eq!(g.dtype(), e.dtype());
            prop_assert_eq!(bits(g), bits(e), "program: {}", oxiflow_compile::explain(&c));
        }
    }
}
